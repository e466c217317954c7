"""Sampling parameters, requests and the output deltas the engine hands to consumers.

Plain Python (no torch): the scheduler and the HTTP edge import this without a model.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field


class InvalidRequest(ValueError):
    """A request the engine refuses; the message says what was wrong, what is allowed, what was given."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class QueueFull(RuntimeError):
    """The waiting queue is at `max_queue`: the caller should answer 429 and retry later."""


def _check(ok: bool, param: str, allowed: str, given) -> None:
    if not ok:
        raise InvalidRequest(f"`{param}` must be {allowed}. Given: {given!r}", param=param)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request. Frozen and validated at construction.

    temperature 0 means greedy (argmax), which matches `model.generate(do_sample=False)`.
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

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "an integer >= 1", self.max_tokens)
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
               "min_tokens", f"an integer between 0 and max_tokens ({self.max_tokens})", self.min_tokens)
        _check(self.temperature >= 0 and self.temperature == self.temperature, "temperature", ">= 0", self.temperature)
        _check(0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "an integer >= 0 (0 = off)", self.top_k)
        _check(0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        _check(self.repetition_penalty > 0, "repetition_penalty", "> 0", self.repetition_penalty)
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", "in [-2, 2]", self.presence_penalty)
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        _check(self.seed is None or isinstance(self.seed, int), "seed", "an integer or null", self.seed)
        _check(len(self.stop) <= 16 and all(isinstance(s, str) and s for s in self.stop),
               "stop", "at most 16 non-empty strings", list(self.stop))
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", "non-negative integers", list(self.stop_token_ids))
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
               "logprobs", "null or an integer between 0 and 20", self.logprobs)
        _check(isinstance(self.n, int) and 1 <= self.n <= 16, "n", "an integer between 1 and 16", self.n)

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


@dataclass(slots=True)
class CompletionOutput:
    """What `LLM.generate` returns per sample: the whole text and tokens."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprob] | None = None


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
    request_id: str  # the client's request id (shared by the n samples)
    index: int  # which of the request's n samples
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
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

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
