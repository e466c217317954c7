"""One request, whichever way it came in: every entrance (the page, MCP, `/chat`, each `/v1` route)
fills a `ChatJob` from its own body, and `prepare` turns it into the engine's prompt(s) and
`SamplingParams` with one set of defaults (the model's generation config, then rill's;
frontend/sampling_defaults.py). `start_job` admits what `prepare` built.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from engine.request import MAX_CHARS_PER_TOKEN, Constraint, InvalidRequest, SamplingParams, prompt_char_limit
from frontend.admission import Generation, check_prompt_chars, compile_constraint, off_loop, start_generation
from frontend.images import load_images
from frontend.sampling_defaults import RILL_SAMPLING, SamplingDefaults
from frontend.tools import ToolFormat, ToolRequest, tool_format


@dataclass(slots=True)
class Sampling:
    """A request's sampling fields as its body gave them; None: unset (the defaults decide)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0: off
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | str | None = ()
    stop_token_ids: tuple[int, ...] | list[int] | None = ()
    ignore_eos: bool = False
    n: int = 1
    max_reasoning_tokens: int | None = None  # None or 0 on the page: no limit but max_tokens
    cache_salt: str | None = None


@dataclass(slots=True)
class ChatJob:
    """A request in one shape, whatever API it came through: a conversation (through the chat
    template) or raw prompts, its sampling, its output rules, and the names its API gives fields."""

    messages: list[dict] | None = None  # {"role", "content", "tool_calls"?, "tool_call_id"?, "name"?}
    prompts: list[str | list[int]] | None = None  # instead of messages: text or token ids, no template
    sampling: Sampling = field(default_factory=Sampling)
    max_tokens: int | None = None  # None: rill's default (--max-new-tokens); with `open_ended` what the context leaves
    open_ended: bool = False  # OpenAI's rule: an unset max_tokens is the room the context leaves
    tools: ToolRequest | None = None  # None: no tools (or tool choice "none")
    constraint: Constraint | None = None  # the body's own format; tools take precedence
    template_kwargs: dict | None = None
    logprobs: int | None = None
    fit_context: bool = False  # the page: the oldest turns dropped (and the answer cut) until it fits
    param: str = "messages"  # the field a prompt too long is blamed on
    format_param: str = "response_format"  # the field a constraint that cannot compile is blamed on
    max_tokens_param: str = "max_tokens"  # the API's name of max_tokens (/chat and the page: max_new_tokens)
    stop_param: str = "stop"  # the API's name of the stop strings (Anthropic's: stop_sequences)
    images: list | None = None  # frontend.images.ImageRef in order; `messages` hold a {"type": "image"} part for each


@dataclass(frozen=True, slots=True)
class RequestDefaults:
    """What an unset field takes: the model's sampling over rill's, and rill's answer length."""

    sampling: SamplingDefaults = SamplingDefaults()  # the model's (frontend.sampling_defaults)
    max_new_tokens: int = 512  # --max-new-tokens

    def resolved(self) -> dict:
        """temperature, top_p, top_k, min_p, repetition_penalty as an unset field gets them."""
        return {name: self.sampling.get(name, fallback) for name, fallback in RILL_SAMPLING.items()}


@dataclass(slots=True)
class Prepared:
    """A job ready for admission: its prompt(s) in tokens, its parameters, and what the page warns about."""

    prompts: list[list[int]]
    params: SamplingParams
    fmt: ToolFormat | None  # the model's tool format when the job has tools
    dropped_turns: int = 0  # the page's oldest turns left out to fit the context
    asked_max_tokens: int = 0  # the answer length asked (params.max_tokens is less when the context is short)
    images: object | None = None  # engine.model.vision.PromptImages of the one prompt, when the job has images


def _renamed(exc: InvalidRequest, job: ChatJob) -> InvalidRequest:
    """The engine's error in the API's own field names (max_tokens, a constraint's field)."""
    if exc.param == "max_tokens" and job.max_tokens_param != "max_tokens":
        return InvalidRequest(str(exc).replace("max_tokens", job.max_tokens_param), job.max_tokens_param)
    if exc.param == "stop" and job.stop_param != "stop":
        return InvalidRequest(str(exc).replace("`stop`", f"`{job.stop_param}`"), job.stop_param)
    if exc.param == "response_format" and job.format_param != "response_format" and job.tools is None:
        return InvalidRequest(str(exc), job.format_param)
    return exc


def sampling_params(job: ChatJob, max_tokens: int, defaults: RequestDefaults, reasoning: bool = False,
                    constraint: Constraint | None = None) -> SamplingParams:
    """The engine's parameters of a job: unset fields take `defaults` (the model's, then rill's).
    `SamplingParams` checks every field (type, range) and names it."""
    s, fallback = job.sampling, defaults.resolved()
    unset = lambda name: fallback[name] if getattr(s, name) is None else getattr(s, name)  # noqa: E731
    budget = s.max_reasoning_tokens
    try:
        return SamplingParams(
            max_tokens=max_tokens, min_tokens=min(s.min_tokens, max_tokens),
            temperature=unset("temperature"), top_p=unset("top_p"), top_k=unset("top_k"), min_p=unset("min_p"),
            repetition_penalty=unset("repetition_penalty"), presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty, seed=s.seed, stop=s.stop, stop_token_ids=s.stop_token_ids,
            ignore_eos=s.ignore_eos, logprobs=job.logprobs, n=s.n, constraint=constraint, reasoning=reasoning,
            max_reasoning_tokens=min(budget, max_tokens) if isinstance(budget, int) and isinstance(max_tokens, int)
            else budget,
            cache_salt=s.cache_salt)
    except InvalidRequest as exc:
        raise _renamed(exc, job) from None


def default_max_tokens(engine, num_prompt_tokens: int) -> int:
    """OpenAI's default: whatever room the context (and the KV cache) leaves; at least 1, so that
    a prompt that fills the context gets check_prompt's message."""
    room = engine.max_model_len
    if engine.kv_cache_tokens is not None:
        room = min(room, engine.kv_cache_tokens)
    return max(1, room - num_prompt_tokens)


def _template_messages(engine, job: ChatJob) -> tuple[list[dict], list[dict] | None, ToolFormat | None]:
    """The job's messages as the template takes them, the tools it passes, and the tool format."""
    tools = job.tools
    fmt = tool_format(engine.tokenizer) if tools is not None else None
    messages = job.messages
    if fmt is not None or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        messages = (fmt or tool_format(engine.tokenizer)).messages(messages, tools)
    template_tools = [dict(t) for t in tools.tools] if fmt is not None and fmt.passes_tools else None
    return messages, template_tools, fmt


async def encode(engine, job: ChatJob, max_tokens: int | None = None) -> tuple[list[list[int]], ToolFormat | None,
                                                                             int, int | None, object]:
    """The job's prompt(s) in tokens (a 400 when one is too long in characters, before tokenizing, or
    the template refuses it), the tool format, and with `fit_context` the turns dropped and the answer
    budget left (else `max_tokens` as given), and the prompt's `PromptImages` (None without images)."""
    if job.messages is None:
        for prompt in job.prompts:
            if isinstance(prompt, str):
                check_prompt_chars(engine, len(prompt), job.param)
        prompts = await off_loop(lambda: [engine.encode(p) if isinstance(p, str) else list(p) for p in job.prompts])
        return prompts, None, 0, max_tokens, None
    if job.images:
        return await _encode_images(engine, job, max_tokens)
    messages, template_tools, fmt = _template_messages(engine, job)
    if job.fit_context:
        fitted = await off_loop(fit_to_context, engine, messages, max_tokens)
        return [fitted.prompt_token_ids], fmt, fitted.dropped_turns, fitted.max_tokens, None
    check_prompt_chars(engine, sum(len(m.get("content") or "") + (len(json.dumps(m["tool_calls"])) if m.get("tool_calls")
                                                                 else 0) for m in messages)
                       + (len(json.dumps(template_tools)) if template_tools else 0), job.param)
    ids = await off_loop(lambda: engine.encode_chat(messages, True, template_tools, **(job.template_kwargs or {})))
    return [ids], fmt, 0, max_tokens, None


def _text_chars(message: dict) -> int:
    """Characters of a message's text (a list content: its text parts)."""
    content = message.get("content") or ""
    return len(content) if isinstance(content, str) else sum(len(p["text"]) for p in content if p["type"] == "text")


async def _encode_images(engine, job: ChatJob, max_tokens: int | None) -> tuple[list[list[int]], None, int, int | None,
                                                                             object]:
    """A conversation with images through the model's processor (decoding and the processor in a
    worker thread): its prompt, image tokens expanded, and its `PromptImages`. 400 for a text model."""
    if engine.vision is None:
        raise InvalidRequest(f"This model ({engine.model_name}) takes text only; the request has {len(job.images)} "
                             "image(s). Send text alone, or serve a vision-language model (--model).", job.param)
    if job.tools is not None:
        raise InvalidRequest("Tools and images in one request are not served yet: send one or the other.", "tools")
    check_prompt_chars(engine, sum(_text_chars(m) for m in job.messages), job.param)
    ids, images = await off_loop(lambda: engine.vision.prepare(job.messages, load_images(job.images), job.template_kwargs))
    return [ids], None, 0, max_tokens, images


async def prepare(engine, job: ChatJob, defaults: RequestDefaults, client: str | None = None) -> Prepared:
    """The job's prompt(s) and parameters, its constraint compiled (for `client`'s compile slots):
    a 400 (InvalidRequest or ApiError) for anything wrong, the parameters checked before any tokenizing."""
    asked = job.max_tokens or defaults.max_new_tokens
    reasoning = engine.think_tags is not None
    params = sampling_params(job, asked, defaults, reasoning, job.constraint)  # every field checked first
    prompts, fmt, dropped, max_tokens, images = await encode(engine, job, asked)
    if job.max_tokens is None and job.open_ended:
        max_tokens = default_max_tokens(engine, max(len(p) for p in prompts))
    constraint = fmt.constraint(job.tools, engine.tokenizer) if fmt is not None else job.constraint
    if max_tokens != asked or constraint is not job.constraint:
        params = sampling_params(job, max_tokens, defaults, reasoning, constraint)
    try:
        await compile_constraint(engine, params, client=client)
    except InvalidRequest as exc:
        raise _renamed(exc, job) from None
    return Prepared(prompts, params, fmt, dropped, asked, images)


async def start_job(engine, job: ChatJob, prepared: Prepared, label: str, **admission) -> list[Generation]:
    """Admits each prompt of a prepared job (400/429/503 before any answer starts); one generation
    per prompt, labelled `label` (then `label-i` for several). `admission`: `Generation`'s keywords
    (timeout, metrics, route, session, client, on_admit)."""
    gens: list[Generation] = []
    try:
        for i, ids in enumerate(prepared.prompts):
            rid = label if len(prepared.prompts) == 1 else f"{label}-{i}"
            extra = {"images": prepared.images} if prepared.images is not None else {}
            gens.append(await start_generation(engine, ids, prepared.params, rid, **admission, **extra))
    except InvalidRequest as exc:
        for gen in gens:
            gen.abort()
        raise _renamed(exc, job) from None
    except BaseException:
        for gen in gens:
            gen.abort()
        raise
    return gens


# --- a conversation fitted to the context (the page) ----------------------------------------------

@dataclass(slots=True)
class FittedPrompt:
    """A prompt that fits the context: its tokens, how many old turns were dropped, the answer budget."""

    prompt_token_ids: list[int]
    dropped_turns: int
    max_tokens: int  # the answer's token budget (max_new_tokens, or less where the context is short)


def _turns(messages: list[dict]) -> list[list[dict]]:
    """Groups messages into turns, each starting at a user message."""
    turns: list[list[dict]] = []
    for message in messages:
        if message["role"] == "user" or not turns:
            turns.append([message])
        else:
            turns[-1].append(message)
    return turns


def fit_to_context(engine, messages: list[dict], max_new_tokens: int) -> FittedPrompt:
    """Tokens of `messages` ([system] + history + the last user message), dropping the oldest turns
    of the history until the answer fits (blocking: a worker thread).

    The fewest turns dropped is found by binary search (the prompt only shrinks as turns go), so a
    conversation of T turns costs about log2(T) + 2 template renders; turns that alone exceed the
    character bound of the context are dropped before any render. Raises `InvalidRequest` when even
    the last message alone leaves no room for an answer.
    """
    context = int(engine.max_model_len)
    system = [m for m in messages[:1] if m["role"] == "system"]
    user = messages[-1:]
    history = [m for m in messages[len(system):-1] if m["role"] != "system"]  # the page's system prompt wins
    char_limit = prompt_char_limit(context)
    fixed_chars = sum(len(m["content"]) for m in system + user)
    if fixed_chars > char_limit:
        raise InvalidRequest(f"The message is too long: with the system prompt it has {fixed_chars} characters, "
                             f"and the model's context of {context} tokens takes at most {char_limit} characters "
                             f"({MAX_CHARS_PER_TOKEN} per token). Shorten the message or the system prompt.",
                             "message")
    turns = _turns(history)
    turn_chars = [sum(len(m["content"]) for m in turn) for turn in turns]
    first, chars = 0, fixed_chars + sum(turn_chars)
    while chars > char_limit:  # these oldest turns cannot fit whatever they tokenize to
        chars -= turn_chars[first]
        first += 1
    rendered: dict[int, list[int]] = {}  # turns dropped -> the prompt's token ids

    def render(dropped: int) -> list[int]:
        if dropped not in rendered:
            rendered[dropped] = engine.encode_chat(system + [m for turn in turns[dropped:] for m in turn] + user)
        return rendered[dropped]

    def fits(dropped: int) -> bool:
        return len(render(dropped)) + max_new_tokens <= context

    if fits(first):
        dropped = first
    elif first == len(turns) or not fits(len(turns)):
        dropped = len(turns)
        ids = render(dropped)
        room = context - len(ids)
        if room < 1:
            raise InvalidRequest(f"The message is too long: with the system prompt it takes {len(ids)} tokens, "
                                 f"and the model's context holds {context} tokens in all (prompt and answer). "
                                 "Shorten the message or the system prompt.", "message")
        return FittedPrompt(ids, dropped, room)  # the answer is cut short to fit
    else:
        too_few, enough = first, len(turns)  # fits(too_few) is false, fits(enough) true
        while enough - too_few > 1:
            middle = (too_few + enough) // 2
            if fits(middle):
                enough = middle
            else:
                too_few = middle
        dropped = enough
    return FittedPrompt(rendered[dropped], dropped, max_new_tokens)

