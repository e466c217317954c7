"""Constrained decoding with llguidance: what a request asks for (`Constraint`, plain data), its
compiled grammar (compiled off the engine thread, bounded, cached), and each sequence's matcher.

A `Constraint` travels inside `SamplingParams` (frozen, picklable: it may cross a process
boundary); the engine side turns it into an `llguidance.LLMatcher` through `GrammarCompiler`,
which compiles each distinct constraint once in its own worker threads (llguidance drops the GIL
while it builds a grammar) under llguidance's parser and lexer limits, with a timeout, and keeps
the last `cache_size` results, failures included (a hostile schema sent again costs nothing).

Per step, `fill_bitmasks` writes one bitmask row (one bit per token id, 32 per int32 word) for
each constrained sequence only; the sampler turns them into -inf on the forbidden logits.
Numpy, no torch.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections import OrderedDict

import numpy as np

from engine.request import Constraint, InvalidRequest, QueueFull

log = logging.getLogger("rill.engine")


def compile_workers(cpus: int | None = None) -> int:
    """Grammars compiling at once: one per two cores, at least one (on a 2-core CPU Space two busy
    compiles would take both cores from decoding; more compiles wait in line)."""
    cpus = cpus if cpus is not None else len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    return max(1, min(2, cpus // 2))


def _lower_priority() -> None:
    """A compile worker's initializer: on Linux a thread has its own niceness (setpriority on its
    thread id), so the grammar it compiles (llguidance works outside the GIL) yields the cores to
    the engine's decoding whenever both want them; elsewhere the worker runs at normal priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)
    except (AttributeError, OSError) as exc:  # not Linux, or not allowed: the one-worker bound still holds
        log.debug("grammar compiles keep their priority: %s", exc)

COMPILE_TIMEOUT_S = 10.0  # a compile still running after this is a 400 (llguidance's limits end it soon after)
COMPILE_NICE = 10  # the compile threads' niceness (Linux): a compiling grammar takes CPU decoding leaves idle
MAX_PENDING_COMPILES = 32  # compiles running or waiting; beyond it a request is refused (QueueFull: 429)
CACHE_SIZE = 128  # compiled constraints kept (least recently used dropped first)
MAX_ERROR_CHARS = 600  # of llguidance's message, in the 400


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")


def closed_objects(schema):
    """The schema with `additionalProperties: false` on every object schema with `properties` that
    does not say (OpenAI's strict mode: only the declared keys). A copy; it walks schema positions
    only (a property named "properties" is a name, not a keyword)."""
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(closed.get(key), dict):
            closed[key] = {name: closed_objects(sub) for name, sub in closed[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(closed.get(key), list):
            closed[key] = [closed_objects(sub) for sub in closed[key]]
    for key in _SCHEMAS:
        if key in closed:
            value = closed[key]
            closed[key] = [closed_objects(v) for v in value] if isinstance(value, list) else closed_objects(value)
    if "properties" in closed and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint (not yet checked). JSON is written compact (no
    optional whitespace: a model cannot pad it without end). A schema's objects are closed, strict
    or not (as xgrammar's strict mode in vLLM and SGLang): a small model otherwise invents keys until
    max_tokens; a schema that states `additionalProperties: true` keeps them open."""
    import json

    import llguidance

    options = {"whitespace_flexible": False, "lenient": not constraint.strict}
    if constraint.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
    if constraint.kind == "json_schema":
        schema = closed_objects(json.loads(constraint.value))  # unstated additionalProperties: false
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if constraint.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(constraint.value)
    return llguidance.LLMatcher.grammar_from_lark(constraint.value)


class GrammarCompiler:
    """Compiles constraints for one tokenizer: off the caller's thread, with a timeout, cached.

    `compile(constraint)` (any thread but the engine's; blocks up to `timeout_s`) raises
    `InvalidRequest` with llguidance's reason, or when compiling took too long; `matcher(constraint)`
    (the engine thread) hands out a fresh matcher, from the cache when it was compiled before.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], timeout_s: float = COMPILE_TIMEOUT_S,
                 cache_size: int = CACHE_SIZE, workers: int | None = None):
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width: the model's vocabulary, maybe more than the tokenizer's
        self.eos_token_ids = list(eos_token_ids)
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._lock = threading.Lock()  # the cache and the pending compiles
        self._tokenizer_lock = threading.Lock()  # the one build of llguidance's tokenizer (a second)
        self._cache: OrderedDict[Constraint, object] = OrderedDict()  # constraint -> LLMatcher template or error str
        self._pending: dict[Constraint, concurrent.futures.Future] = {}
        self.waits = True  # `matcher` may wait for a compile; False on the engine thread's (it never waits)
        self._pool = concurrent.futures.ThreadPoolExecutor(workers or compile_workers(), thread_name_prefix="rill-grammar",
                                                           initializer=_lower_priority)
        self._ll_tokenizer = None
        self._executor = None

    @property
    def words(self) -> int:
        """int32 words of one bitmask row."""
        return (self.vocab_size + 31) // 32

    def ll_tokenizer(self):
        """llguidance's view of the tokenizer (about a second to build; built once, on first use)."""
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                try:
                    self._ll_tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                                      eos_token=self.eos_token_ids or None)
                except ValueError as exc:  # a slow (Python) tokenizer
                    raise InvalidRequest(f"Constrained output needs a fast tokenizer; this model's cannot be used "
                                         f"({exc}).", "response_format") from None
            return self._ll_tokenizer

    def _build(self, constraint: Constraint):
        """Worker thread: an LLMatcher template, or the error message."""
        import llguidance

        try:
            text = grammar_text(constraint)
        except (ValueError, TypeError) as exc:
            return f"{exc}"
        except RecursionError:
            return "it is nested too deeply"
        limits = llguidance.LLParserLimits()  # fuel and size bounds: a hostile grammar fails fast
        matcher = llguidance.LLMatcher(self.ll_tokenizer(), text, log_level=0, limits=limits)
        if matcher.is_error():
            return matcher.get_error()
        return matcher

    def _done(self, constraint: Constraint, future: concurrent.futures.Future) -> None:
        try:
            result = future.result()
        except InvalidRequest as exc:
            result = str(exc)
        except Exception as exc:  # a bug in the binding: the request gets its text, the cache remembers
            result = f"{type(exc).__name__}: {exc}"
        with self._lock:
            self._pending.pop(constraint, None)
            self._cache[constraint] = result
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    def submit(self, constraint: Constraint) -> concurrent.futures.Future:
        """The compile of `constraint`, shared with any request already compiling it."""
        with self._lock:
            if constraint in self._cache:
                self._cache.move_to_end(constraint)
                future = concurrent.futures.Future()
                future.set_result(self._cache[constraint])
                return future
            future = self._pending.get(constraint)
            if future is not None:
                return future
            if len(self._pending) >= MAX_PENDING_COMPILES:
                raise QueueFull(f"Too many grammars are compiling ({len(self._pending)}); retry in a moment.")
            future = self._pool.submit(self._build, constraint)
            self._pending[constraint] = future
        # Outside the lock: a compile that is already done runs `_done` right here, and `_done` takes
        # the lock (inside it, that deadlocked every compile and the engine thread with them).
        future.add_done_callback(lambda f, c=constraint: self._done(c, f))
        return future

    def compile(self, constraint: Constraint) -> None:
        """Blocks until `constraint` is compiled (then `matcher` finds it cached); raises InvalidRequest
        when it does not compile, or not within `timeout_s` (the compile is left to llguidance's limits)."""
        self._check(constraint, self.submit(constraint), self.timeout_s)

    def result(self, constraint: Constraint, future: concurrent.futures.Future):
        """The compiled template of a `submit` future that an async caller awaited (it never blocks):
        InvalidRequest when it did not compile, or is not done (its caller waited `timeout_s`)."""
        return self._check(constraint, future, 0)

    def _check(self, constraint: Constraint, future, timeout: float | None):
        try:
            result = future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise InvalidRequest(f"The {constraint.label} did not compile within {self.timeout_s:g} s; "
                                 "simplify it (less nesting, shorter enums and alternations).",
                                 constraint.param) from None
        if isinstance(result, str):
            message = result if len(result) <= MAX_ERROR_CHARS else result[:MAX_ERROR_CHARS] + "..."
            raise InvalidRequest(f"The {constraint.label} cannot be used for constrained output: {message}",
                                 constraint.param)
        return result

    def cached(self, constraint: Constraint) -> bool:
        """Compiled (or refused) and in the cache: `matcher` answers at once."""
        with self._lock:
            return constraint in self._cache

    def matcher(self, constraint: Constraint):
        """A fresh matcher at the start of `constraint`: cached after `compile`; otherwise compiled now
        (`LLM`, in its caller's thread), or, where `waits` is off (the engine thread), refused."""
        future = self.submit(constraint)
        if not self.waits and not future.done():
            raise InvalidRequest(f"The {constraint.label} was not compiled before it reached the engine; "
                                 "send the request again.", constraint.param)
        return self._check(constraint, future, None).deep_copy()

    def executor(self):
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor(num_threads=2)
        return self._executor

    def fill_bitmasks(self, matchers: list) -> np.ndarray:
        """[len(matchers), words] int32: row i has bit t set where token t may come next for matcher i."""
        bitmask = np.zeros((len(matchers), self.words), dtype=np.int32)
        if len(matchers) == 1:
            matchers[0].unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
        else:
            self.executor().unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)],
                                                    bitmask.ctypes.data, self.words * 4, len(matchers))
        return bitmask


def allowed_tokens(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """[rows, words] int32 bitmask -> [rows, vocab] bool; ids past the mask's bits are forbidden."""
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little").astype(bool)
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    return np.concatenate([bits, np.zeros((bits.shape[0], vocab - bits.shape[1]), dtype=bool)], axis=1)


class GrammarState:
    """One sequence's progress through its constraint (engine thread only).

    `active` is False while the model thinks (engine/reasoning.py): the grammar applies to the
    answer, after the thought.
    """

    __slots__ = ("matcher", "active")

    def __init__(self, matcher, active: bool = True):
        self.matcher = matcher
        self.active = active

    def accept(self, token_id: int) -> bool:
        """Advance past the sampled token; False when the grammar does not allow it (an error)."""
        return self.matcher.consume_token(token_id)

    @property
    def complete(self) -> bool:
        """The grammar can take nothing more: the answer is done."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error() or "the grammar allows no further token"
