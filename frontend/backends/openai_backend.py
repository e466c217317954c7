"""The openai backend: the page, /chat and /v1 stream from a remote OpenAI-compatible server
(vLLM, a vLLM router, llama-server, another rill; TGI where it takes token-id prompts).

Tokenization stays in front: the front loads the model's tokenizer (--model names it; only the
tokenizer, never the weights), renders the chat template, applies every limit of its own, and
sends the prompt as token ids to the remote's `/v1/completions` (`"prompt": [ids]`, which vLLM,
llama-server and rill accept). So the prompt, its length, the page's trimming and the usage
counts are exactly what the local backend has. What the remote does not say back: which token
ids it generated (the stream carries text). Hence:

- each streamed chunk with text counts as one token (its id unknown: `UNKNOWN_TOKEN`), topped up
  to the remote's `usage.completion_tokens` at the end;
- a request cannot continue from its output ids (`continuable = False`): a /chat stream whose
  reader left keeps generating in the remote for the resume window, and a reader who comes back
  gets the rest as it arrives;
- logprobs are refused (400).

Remote answers map to rill's: 400/404/413/422 -> 400 with the remote's message; 429 -> 429
(its Retry-After); 401/403 -> 503 (rill's key for the remote is wrong); 5xx, a refused or timed
out connection -> 503 naming the remote. A probe of `GET /v1/models` every `PROBE_PERIOD_S`
marks the remote down or up: while it is down new requests get 503 at once, and a waiting
stream ends with an error within a second.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.parse
from pathlib import Path

import httpx

from engine.core import EngineStats
from engine.request import FinishReason, RequestOutput, SamplingParams
from frontend.backends import BackendError
from frontend.backends.remote import Admitted, Refused, RemoteEngine

log = logging.getLogger("rill.backend")

UNKNOWN_TOKEN = -1  # a generated token whose id the remote did not say
PROBE_PERIOD_S = 1.0
CONNECT_TIMEOUT_S = 5.0
START_WAIT_S = 30.0  # at start, how long the remote may take to answer its first /v1/models
_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


def load_tokenizer(model_id: str | None, trust_remote_code: bool = False):
    """The tokenizer the local backend would load for `model_id` (the embedded model's when None),
    without the weights. Raises ModelLoadError."""
    from transformers import AutoTokenizer

    from engine.model import loading

    model_id = (model_id or "").strip()
    gguf = loading.embedded_gguf_path() if not model_id else (
        Path(model_id).expanduser().resolve() if model_id.lower().endswith(".gguf") else None)
    try:
        if gguf is not None:
            from engine.model.gguf_header import gguf_tokenizer

            return gguf_tokenizer(gguf, trust_remote_code)  # the one the local backend reads from the file
        return AutoTokenizer.from_pretrained(model_id or loading.DEFAULT_HUB_ID, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        raise loading.ModelLoadError(f"could not load the tokenizer of {model_id or 'the embedded model'!r}: "
                                     f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}; the "
                                     "openai backend tokenizes in front: --model must name the remote's model "
                                     "(its folder, .gguf or hub id)") from exc


def _error_text(body: bytes) -> str:
    """The remote's error message from an OpenAI-shaped (or plain) error body."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip()[:500] or "no message"
    error = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(error, dict):
        return str(error.get("message") or error.get("detail") or error)[:500]
    return str(error)[:500]


def request_body(model: str, prompt_token_ids: list[int], params: SamplingParams) -> dict:
    """The remote /v1/completions body: OpenAI's fields, and the common extensions only when used."""
    body = {"model": model, "prompt": list(prompt_token_ids), "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": params.max_tokens,
            "temperature": params.temperature, "top_p": params.top_p, "n": params.n}
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop:
        body["stop"] = list(params.stop)
    for name, default in (("top_k", 0), ("min_p", 0.0), ("repetition_penalty", 1.0), ("presence_penalty", 0.0),
                          ("frequency_penalty", 0.0), ("min_tokens", 0), ("ignore_eos", False),
                          ("skip_special_tokens", True)):
        value = getattr(params, name)
        if value != default:
            body[name] = value
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    if params.cache_salt is not None:  # vLLM takes it; the remote's prefix cache is shared too
        body["cache_salt"] = params.cache_salt
    return body


def redact_url(url: str) -> str:
    """`url` as it may be shown (/health, error text, the log): credentials before the host and every
    query value replaced by `***`, the query's names and the rest kept."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    query = "&".join(f"{name}=***" for name, _ in urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def split_credentials(url: str) -> tuple[str, httpx.BasicAuth | None]:
    """`url` without the user:password before its host, and those as httpx's basic auth: the URL
    httpx logs for each request then carries no credentials."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None:
        return url, None
    host = parts.netloc.rsplit("@", 1)[1]
    auth = httpx.BasicAuth(urllib.parse.unquote(parts.username), urllib.parse.unquote(parts.password or ""))
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment)), auth


class OpenAIEngine(RemoteEngine):
    """The engine client over a remote OpenAI-compatible server."""

    backend = "openai"
    continuable = False

    def __init__(self, url: str, key: str | None, remote_model: str, max_model_len: int, tokenizer, name: str):
        self.shown_url = redact_url(url)  # what /health, errors and the log say: no credentials
        self.url, self._auth = split_credentials(url)
        self.remote_model = remote_model
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._up = True
        self._down_reason = ""
        self.attention_path = f"remote ({self.shown_url})"
        super().__init__(model_name=name, max_model_len=max_model_len, tokenizer=tokenizer)
        self._client: httpx.AsyncClient | None = None
        asyncio.run_coroutine_threadsafe(self._make_client(), self.loop).result()
        self._prober = asyncio.run_coroutine_threadsafe(self._probe_forever(), self.loop)

    @classmethod
    def from_settings(cls, settings) -> "OpenAIEngine":
        url = settings.backend_url.rstrip("/").removesuffix("/v1")
        shown = redact_url(url)
        bare, auth = split_credentials(url)
        headers = {"Authorization": f"Bearer {settings.backend_key}"} if settings.backend_key else {}
        tokenizer = load_tokenizer(settings.model_id, settings.trust_remote_code)
        deadline = time.monotonic() + START_WAIT_S
        while True:
            try:
                response = httpx.get(f"{bare}/v1/models", headers=headers, auth=auth, timeout=CONNECT_TIMEOUT_S)
                break
            except httpx.HTTPError as exc:
                if time.monotonic() > deadline:
                    raise BackendError(f"the model server at {shown} did not answer GET /v1/models within "
                                       f"{START_WAIT_S:g} s ({type(exc).__name__}); start it first, or check "
                                       "--backend-url") from exc
                time.sleep(0.5)
        if response.status_code != 200:
            raise BackendError(f"the model server at {shown} answered GET /v1/models with {response.status_code}: "
                               f"{_error_text(response.content)} (check --backend-key)")
        models = response.json().get("data") or []
        if not models:
            raise BackendError(f"the model server at {shown} lists no model at GET /v1/models")
        card = models[0]
        context = card.get("max_model_len") or settings.max_model_len or getattr(tokenizer, "model_max_length", 0)
        if not isinstance(context, int) or not 0 < context < 10_000_000:
            context = 2048
        if settings.max_model_len:
            context = min(context, settings.max_model_len)
        return cls(url, settings.backend_key, card["id"], context, tokenizer, name=card["id"])

    async def _make_client(self) -> None:
        self._client = httpx.AsyncClient(headers=self._headers, auth=self._auth, timeout=httpx.Timeout(
            connect=CONNECT_TIMEOUT_S, read=None, write=30.0, pool=None), limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=64))

    # ---- is the remote there ---------------------------------------------------------------

    async def _probe_forever(self) -> None:
        while True:
            try:
                response = await self._client.get(f"{self.url}/v1/models", timeout=PROBE_PERIOD_S * 2)
                self._mark(response.status_code == 200, f"it answers GET /v1/models with {response.status_code}")
            except httpx.HTTPError as exc:
                self._mark(False, f"{type(exc).__name__}")
            await asyncio.sleep(PROBE_PERIOD_S)

    def _mark(self, up: bool, reason: str = "") -> None:
        if up != self._up:
            log.warning("the model server at %s is %s%s", self.shown_url, "up" if up else "down",
                        "" if up else f" ({reason})")
        self._up, self._down_reason = up, ("" if up else reason)

    @property
    def alive(self) -> bool:
        return self._up and not self._stopping

    def unavailable_reason(self) -> str:
        return (f"The model server behind this app ({self.shown_url}) is not reachable ({self._down_reason or 'down'}). "
                "Try again in a moment.")

    def stats(self) -> EngineStats:
        with self._lock:
            running = len(self._relays)
        return EngineStats(num_running=running, num_waiting=0, kv_usage=0.0, num_kv_blocks=0, num_free_kv_blocks=0,
                           num_preemptions=0, prompt_tokens_total=0, generation_tokens_total=0, num_steps=0)

    def health_info(self) -> dict:
        return {"backend": "openai", "backend_url": self.shown_url, "remote_model": self.remote_model,
                "remote_reachable": self._up}

    # ---- one request ----------------------------------------------------------------------

    async def _open(self, request_id, prompt_token_ids, params: SamplingParams, prior_output_ids, session):
        if params.logprobs is not None:
            raise Refused("invalid", "`logprobs` are not available with --backend openai (the remote's tokens "
                                     "come back as text only).", "logprobs")
        if prior_output_ids:
            raise Refused("invalid", "A request cannot continue from prior output with --backend openai.")
        body = request_body(self.remote_model, prompt_token_ids, params)
        headers = {"x-request-id": request_id, **({"x-session-id": session} if session else {})}
        try:
            async with self._client.stream("POST", f"{self.url}/v1/completions", json=body,
                                           headers=headers) as response:
                if response.status_code != 200:
                    raise self._refusal(response.status_code, await response.aread(), response.headers)
                yield Admitted(self.shown_url)
                async for outputs in self._outputs(request_id, len(prompt_token_ids), params.n, response):
                    yield outputs
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            self._mark(False, type(exc).__name__)
            raise Refused("unavailable", self.unavailable_reason()) from None

    def _refusal(self, status: int, body: bytes, headers) -> Refused:
        text = _error_text(body)
        if status in (400, 404, 413, 422):
            return Refused("invalid", f"The model server refused the request: {text}")
        if status == 429:
            return Refused("queue_full", f"the model server is at capacity ({text})")
        if status in (401, 403):
            return Refused("unavailable", f"The model server refused this app's key (HTTP {status}); the "
                                          "operator must fix --backend-key.")
        return Refused("unavailable", f"The model server answered HTTP {status}: {text}.")

    async def _outputs(self, request_id: str, num_prompt_tokens: int, n: int, response):
        """Lists of RequestOutput from the remote's SSE stream; the finishing ones wait for the usage."""
        counts = [0] * n
        held: list[RequestOutput] = []  # finished samples, until the usage chunk tops their counts up
        event = None
        async for line in response.aiter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
                continue
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if event == "error" or "error" in chunk or chunk.get("object") == "error":
                message = _error_text(data.encode())
                done = {h.index for h in held}
                yield held + [RequestOutput(request_id, index, [], "", finished=True, finish_reason=FinishReason.ERROR,
                                            error=f"The model server failed: {message}",
                                            num_prompt_tokens=num_prompt_tokens, num_output_tokens=counts[index])
                              for index in range(n) if index not in done]
                return
            event = None
            outputs = []
            for choice in chunk.get("choices") or []:
                index = int(choice.get("index", 0))
                text = choice.get("text") or ""
                if text:
                    counts[index] += 1
                reason = choice.get("finish_reason")
                out = RequestOutput(request_id, index, [UNKNOWN_TOKEN] if text else [], text,
                                    num_prompt_tokens=num_prompt_tokens, num_output_tokens=counts[index])
                if reason is not None:
                    out.finished, out.finish_reason = True, _REASONS.get(reason, FinishReason.STOP)
                    held.append(out)
                else:
                    outputs.append(out)
            usage = chunk.get("usage")
            if usage and held and n == 1:
                extra = int(usage.get("completion_tokens", counts[0]) or 0) - counts[0]
                if extra > 0:
                    held[0].token_ids += [UNKNOWN_TOKEN] * extra
                    held[0].num_output_tokens += extra
            if outputs:
                yield outputs
            if usage and held:
                yield held
                held = []
        if held:
            yield held

    def failure_message(self, exc: BaseException) -> str:
        return (f"The connection to the model server ({self.shown_url}) broke off mid-answer; it may have stopped. "
                "Send the request again in a moment.")

    def _close(self) -> None:
        self._prober.cancel()
        if self._client is not None:
            asyncio.run_coroutine_threadsafe(self._client.aclose(), self.loop).result(5)
