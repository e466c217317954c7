"""Sampling parameters, requests and the output deltas the engine hands to consumers.

Plain Python (no torch): the scheduler and the HTTP edge import this without a model.
"""

from __future__ import annotations

import enum
import itertools
import json
import math
import time
from dataclasses import dataclass, field


class InvalidRequest(ValueError):
    """A request the engine refuses; the message says what was wrong, what is allowed, what was given."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class QueueFull(RuntimeError):
    """The waiting queue is at `max_queue`: the caller should answer 429 and retry later."""


MAX_STOP_STRINGS = 16  # stop strings per request
MAX_STOP_LENGTH = 256  # characters per stop string
MAX_N = 16  # samples per request
MAX_STOP_TOKEN_IDS = 1024  # ids in one request's stop_token_ids (vLLM's users send a few; a whole small vocabulary fits)
MAX_CACHE_SALT_CHARS = 256  # a request's prefix-cache salt
MAX_SEED = 2**63 - 1  # seeds are 64-bit signed integers (a sample's generator gets seed + index)
MIN_SEED = -(2**63)
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0
MAX_TOKEN_ID = 2**31 - 1
MAX_CHARS_PER_TOKEN = 16  # no real text averages more characters per token than this


def stop_token_ids_message(given: int) -> str:
    """The 400 for too many stop token ids (the HTTP edge and SamplingParams say the same)."""
    return f"`stop_token_ids` may hold at most {MAX_STOP_TOKEN_IDS} token ids; {given} given"


def prompt_char_limit(max_model_len: int) -> int:
    """The most characters a prompt (or a conversation) may have before it is tokenized: at
    `MAX_CHARS_PER_TOKEN` characters per token, anything longer cannot fit the context, so it is
    refused without spending the tokenizer's time on it."""
    return int(max_model_len) * MAX_CHARS_PER_TOKEN


def _check(ok: bool, param: str, allowed: str, given) -> None:
    if not ok:
        raise InvalidRequest(f"`{param}` must be {allowed}. Given: {_shown(given)}", param=param)


def _shown(value) -> str:
    """`value` for an error message, cut short (a 1 MB string is not echoed back)."""
    text = repr(value)
    return text if len(text) <= 200 else f"{text[:200]}... ({len(text)} characters)"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    """A finite int or float (not a bool, not inf or NaN)."""
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


def _real(value, param: str, low: float, high: float, *, low_open: bool = False, allowed: str) -> None:
    ok = _is_real(value) and (low < value if low_open else low <= value) and value <= high
    _check(ok, param, allowed, value)


CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "grammar")  # "grammar": a Lark grammar
MAX_CONSTRAINT_CHARS = 200_000  # a schema, regex or grammar longer than this is refused before compiling


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a request's output must match; plain data (a `SamplingParams` field).

    kind: "json_schema" (value: the schema as JSON text), "json_object" (any JSON object; value
    empty), "regex" (value: a regular expression, Rust `regex` syntax, anchored at both ends) or
    "grammar" (value: a Lark grammar in llguidance's dialect, which also takes `%json {...}`).
    strict: for a JSON schema, every keyword must be enforceable (an unsupported one is a 400);
    not strict, unsupported keywords are ignored and the rest is still enforced.
    """

    kind: str
    value: str = ""
    strict: bool = False

    def __post_init__(self):
        if self.kind not in CONSTRAINT_KINDS:
            raise InvalidRequest(f"A constraint's kind must be one of {', '.join(CONSTRAINT_KINDS)}. "
                                 f"Given: {self.kind!r}", "constraint")
        if not isinstance(self.value, str):
            raise InvalidRequest(f"A constraint's value must be a string. Given: {type(self.value).__name__}",
                                 "constraint")
        if not isinstance(self.strict, bool):
            raise InvalidRequest(f"A constraint's strict must be true or false. Given: {self.strict!r}", "constraint")
        if len(self.value) > MAX_CONSTRAINT_CHARS:
            raise InvalidRequest(f"The {self.label} is too long: at most {MAX_CONSTRAINT_CHARS} characters are "
                                 f"allowed. Given: {len(self.value)} characters.", self.param)
        if self.kind in ("json_schema", "regex", "grammar") and not self.value:
            raise InvalidRequest(f"The {self.label} is empty.", self.param)
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.value)
            except ValueError as exc:
                raise InvalidRequest(f"The JSON schema is not valid JSON: {exc}", self.param) from None
            except RecursionError:
                raise InvalidRequest("The JSON schema is nested too deeply to be read.", self.param) from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequest("The JSON schema must be a JSON object (or true/false). "
                                     f"Given: {type(schema).__name__}", self.param)

    @classmethod
    def json_schema(cls, schema: dict | bool | str, strict: bool = False) -> "Constraint":
        """From a schema as a dict (its key order kept: it is the order properties are generated in)."""
        text = schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False)
        return cls("json_schema", text, strict)

    @property
    def label(self) -> str:
        return {"json_schema": "JSON schema", "json_object": "JSON object constraint", "regex": "regex",
                "grammar": "Lark grammar"}[self.kind]

    @property
    def param(self) -> str:
        """The request field a client names it with (the error's `param`)."""
        return {"json_schema": "response_format", "json_object": "response_format"}.get(self.kind, self.kind)



class TokenIds(tuple):
    """`stop_token_ids`: the ids as given (a tuple), with `in` a set lookup made once per request
    (engine/core.py looks up every new token: a scan of a long tuple each time slowed every stream)."""

    def __new__(cls, ids=()):
        self = super().__new__(cls, ids)
        self.set = frozenset(self)
        return self

    def __contains__(self, token_id) -> bool:
        return token_id in self.set

    def __reduce__(self):
        return TokenIds, (tuple(self),)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request. Frozen and validated at construction: every field is checked
    (type, finite, range), and the error names the field, what is allowed and what was given.

    temperature 0 means greedy (argmax), which matches `model.generate(do_sample=False)`; any
    temperature above 0 samples, a tiny one (1e-40) as sharply as greedy, never with NaN (see
    `Sampler`).
    """

    max_tokens: int = 16  # new tokens at most; the request finishes with "length" there
    min_tokens: int = 0  # EOS and stop token ids are masked until this many tokens exist
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # 0 = off; otherwise keep the k most likely tokens
    min_p: float = 0.0  # drop tokens whose probability is below min_p * max probability
    repetition_penalty: float = 1.0  # HF/CTRL style, over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI style, over output tokens
    frequency_penalty: float = 0.0  # OpenAI style, over output tokens
    seed: int | None = None  # per-request generator: same seed + prompt -> same text
    stop: tuple[str, ...] = ()  # text stops; the stop string itself is not returned
    stop_token_ids: tuple[int, ...] = ()  # extra token ids that end the request
    ignore_eos: bool = False  # keep going past EOS until max_tokens
    logprobs: int | None = None  # None = off; N >= 0 = chosen token's logprob and the top N
    n: int = 1  # independent samples of one prompt
    skip_special_tokens: bool = True  # in the detokenized text
    constraint: Constraint | None = None  # the answer must match it (engine/grammar.py); it decides the end
    reasoning: bool = False  # split the model's thought (between its think tags) into RequestOutput.reasoning
    max_reasoning_tokens: int | None = None  # with reasoning: past this many thought tokens the end tag is forced
    cache_salt: str | None = None  # prefix-cache blocks are shared only between requests with the same salt

    def __post_init__(self):
        stop, stop_ids = self.stop, self.stop_token_ids
        if isinstance(stop, str):
            object.__setattr__(self, "stop", (stop,))
        elif stop is None or isinstance(stop, (list, tuple)):
            object.__setattr__(self, "stop", tuple(stop or ()))
        else:
            _check(False, "stop", "a string or a list of strings", stop)
        _check(stop_ids is None or isinstance(stop_ids, (list, tuple)), "stop_token_ids",
               "a list of token ids", stop_ids)
        object.__setattr__(self, "stop_token_ids", tuple(stop_ids or ()))
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "an integer >= 1", self.max_tokens)
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
               "min_tokens", f"an integer between 0 and max_tokens ({self.max_tokens})", self.min_tokens)
        _real(self.temperature, "temperature", 0, MAX_TEMPERATURE,
              allowed=f"a number in [0, {MAX_TEMPERATURE:g}] (0 = greedy)")
        _real(self.top_p, "top_p", 0, 1, low_open=True, allowed="in (0, 1]")
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k", "an integer >= 0 (0 = off)", self.top_k)
        _real(self.min_p, "min_p", 0, 1, allowed="in [0, 1]")
        _real(self.repetition_penalty, "repetition_penalty", 0, MAX_REPETITION_PENALTY, low_open=True,
              allowed=f"a number in (0, {MAX_REPETITION_PENALTY:g}] (1 = off)")
        _real(self.presence_penalty, "presence_penalty", -2, 2, allowed="in [-2, 2]")
        _real(self.frequency_penalty, "frequency_penalty", -2, 2, allowed="in [-2, 2]")
        _check(self.seed is None or (_is_int(self.seed) and MIN_SEED <= self.seed <= MAX_SEED), "seed",
               "null or an integer that fits in 64 bits (-2**63 to 2**63 - 1)", self.seed)
        _check(len(self.stop) <= MAX_STOP_STRINGS and all(isinstance(s, str) and s for s in self.stop),
               "stop", f"at most {MAX_STOP_STRINGS} non-empty strings", list(self.stop))
        for s in self.stop:
            _check(len(s) <= MAX_STOP_LENGTH, "stop", f"strings of at most {MAX_STOP_LENGTH} characters each "
                   f"(one is {len(s)} characters)", s)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(stop_token_ids_message(len(self.stop_token_ids)), "stop_token_ids")
        _check(all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in self.stop_token_ids),
               "stop_token_ids", "non-negative integer token ids", list(self.stop_token_ids))
        object.__setattr__(self, "stop_token_ids", TokenIds(self.stop_token_ids))
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", "true or false", self.ignore_eos)
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
               "logprobs", "null or an integer between 0 and 20", self.logprobs)
        _check(_is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"an integer between 1 and {MAX_N}", self.n)
        _check(isinstance(self.skip_special_tokens, bool), "skip_special_tokens", "true or false",
               self.skip_special_tokens)
        _check(self.cache_salt is None or (isinstance(self.cache_salt, str) and 0 < len(self.cache_salt)
                                           <= MAX_CACHE_SALT_CHARS),
               "cache_salt", f"null or a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
               self.cache_salt if not isinstance(self.cache_salt, str) else f"{len(self.cache_salt)} characters")
        _check(self.constraint is None or isinstance(self.constraint, Constraint), "constraint",
               "null or a Constraint (JSON schema, JSON object, regex or Lark grammar)", self.constraint)
        _check(isinstance(self.reasoning, bool), "reasoning", "true or false", self.reasoning)
        _check(self.max_reasoning_tokens is None or (_is_int(self.max_reasoning_tokens)
                                                     and 0 <= self.max_reasoning_tokens <= self.max_tokens),
               "max_reasoning_tokens", f"null or an integer between 0 and max_tokens ({self.max_tokens})",
               self.max_reasoning_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context reached
    ABORT = "abort"  # cancelled by the client or the server
    ERROR = "error"  # failed inside the engine; `error` says why


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


def new_request_id() -> str:
    return f"req-{int(time.time() * 1000):x}-{next(_ids)}"


@dataclass(slots=True)
class TokenLogprob:
    """The chosen token's logprob and the `top` most likely alternatives [(token_id, logprob)]."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class RequestOutput:
    """One delta for one sequence of a request: what is new since the previous delta.

    Joining `text` of all deltas of a sequence gives its whole text; the last delta has
    `finished=True` and a `finish_reason`.
    """

    request_id: str
    index: int  # which of the `n` samples
    token_ids: list[int]  # new token ids
    text: str  # new text (never a broken UTF-8 character, stop strings removed)
    finished: bool = False
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None  # one per new token when asked
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # so far, for this sample
    error: str | None = None  # set when finish_reason is ERROR
    first_token_time: float | None = None  # time.monotonic() of the first token
    arrival_time: float = 0.0  # time.monotonic() when the engine received the request
    scheduled_time: float | None = None  # time.monotonic() when it first ran (queue time ends)
    reasoning: str = ""  # new text of the model's thought (params.reasoning), apart from `text`


@dataclass(slots=True)
class CompletionOutput:
    """What `LLM.generate` returns per sample: the whole text and tokens."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprob] | None = None
    reasoning: str = ""  # the thought, when params.reasoning split it from the text


@dataclass(slots=True)
class GenerationResult:
    """What `LLM.generate` returns per prompt."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.outputs[0].finish_reason


@dataclass(slots=True, eq=False)
class Sequence:
    """One sample of one request inside the engine: its tokens and how far the KV cache has them.

    The scheduler has no prefill or decode phase: `num_computed_tokens` catches up with
    `len(token_ids)` (prompt, then recomputation after preemption, then one token per step).
    """

    seq_id: str  # unique inside the engine: "<request_id>#<index>"
    request_id: str  # the engine's id of the admission (fresh per add_request; shared by its n samples), not the client's
    index: int  # which of the request's n samples
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    client: object = None  # who sent it, for fair shares (engine/fair_share.py); None: the anonymous client
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_prompt_tokens_computed: int = 0  # high-water mark: recomputed prompt tokens count once
    block_table: list[int] = field(default_factory=list)  # KV block ids, in order
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache names of its full blocks
    num_cached_blocks: int = 0  # leading blocks of block_table named in the prefix cache
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None
    scheduled_time: float | None = None  # first time the scheduler ran it (queue time ends)
    fault: bool = False  # test hook: the next forward including this sequence raises
    grammar: object | None = None  # engine.grammar.GrammarState when params.constraint is set
    reasoning: object | None = None  # engine.reasoning.ReasoningState when params.reasoning on a thinking model
    draft_token_ids: list[int] = field(default_factory=list)  # guessed next tokens to verify this step (engine/speculative.py)
    images: object | None = None  # engine.model.vision.PromptImages: the prompt's pixels and image positions
    image_features: object | None = None  # [image tokens, hidden] tensor while its prefill needs them

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
