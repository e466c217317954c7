"""The synchronous engine step: schedule -> run -> sample -> update. No threads, no asyncio.

    plan = self.scheduler.schedule()
    logits = self.runner.run(plan)
    outputs = self._update(plan, self.sampler.sample(logits, sampling_seqs))
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.attention import PagedKVCache
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer, replacement_is_final
from engine.gpu import paged_decode_kernel
from engine.grammar import GrammarCompiler, GrammarState
from engine.kv_cache import BlockAllocator
from engine.loading import rill_cache_dir
from engine.request import (
    FinishReason,
    InvalidRequest,
    RequestOutput,
    RequestStatus,
    SamplingParams,
    Sequence,
)
from engine.cpu import decode_attention_kernel, keep_freed_memory, linear_kernel, pack_linears
from engine.quant import FusedProjections, QuantLinear
from engine.reasoning import ReasoningState, think_tags
from engine.runner import FallbackRunner, PagedRunner, kv_geometry, supports_paged_attention
from engine.sampler import Sampler, logit_rows
from engine.scheduler import ScheduledChunk, Scheduler

log = logging.getLogger("rill.engine")


@dataclass(slots=True)
class EngineStats:
    """A snapshot for /metrics, the status panel and tests."""

    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of KV blocks in use, 0..1
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_preemptions: int
    prompt_tokens_total: int  # prompt tokens computed, each once (prefix-cache hits and recomputation excluded)
    generation_tokens_total: int
    num_steps: int
    finished_total: dict[str, int] = field(default_factory=dict)  # finish reason -> count
    prefix_cache_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hit_tokens: int = 0  # of which found there (their K/V reused, not computed)


def model_context_length(config) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions", "seq_length", "max_seq_len"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


MEMINFO_PATH = Path("/proc/meminfo")  # the host's memory
CGROUP_ROOT = Path("/sys/fs/cgroup")  # the container's limit: v2 files at the root, v1 under memory/
_NO_LIMIT = 1 << 60  # cgroup v1 says "no limit" with a page-rounded 2**63


def _read_number(path: Path) -> int | None:
    """The integer in a one-line file; None if absent or unreadable; _NO_LIMIT for "max"."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return _NO_LIMIT
    try:
        return int(text)
    except ValueError:
        return None


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def container_free_memory(cgroup_root: Path = CGROUP_ROOT) -> int | None:
    """Bytes the container's memory limit still allows: the limit less the working set (usage
    less reclaimable page cache), from cgroup v2 (`memory.max`) or v1 (`memory.limit_in_bytes`).
    None when there is no limit."""
    for folder, limit_file, usage_file, inactive_key in (
            ("", "memory.max", "memory.current", "inactive_file"),
            ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")):
        base = cgroup_root / folder
        limit = _read_number(base / limit_file)
        if limit is None:
            continue
        if limit >= _NO_LIMIT:
            return None
        usage = _read_number(base / usage_file) or 0
        working_set = max(0, usage - _stat_value(base / "memory.stat", inactive_key))
        return max(0, limit - working_set)
    return None


def host_free_memory(meminfo_path: Path = MEMINFO_PATH) -> int | None:
    try:
        with open(meminfo_path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def free_memory_bytes(device: torch.device, meminfo_path: Path | None = None, cgroup_root: Path | None = None) -> int:
    """Memory a KV cache on `device` may take: the GPU's free memory, or on CPU the smaller of the
    host's available memory and what the container's limit leaves (a Space is a container with a
    limit far below its host's memory); 4 GiB when neither is known."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    known = [m for m in (host_free_memory(meminfo_path or MEMINFO_PATH),
                         container_free_memory(cgroup_root or CGROUP_ROOT)) if m is not None]
    return min(known) if known else 4 << 30


def eos_token_ids(model, tokenizer) -> list[int]:
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


def _is_token_id(value, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


MAX_FAILED_STEPS = 3  # steps in a row whose forward fails for every sequence: the model is broken


class ModelBroken(RuntimeError):
    """The forward failed for every sequence of several steps in a row: the engine must die
    (and be rebuilt, within its max_restarts), since no request can be served."""


class EngineCore:
    """Owns the model, the KV cache and the queues; `step()` advances every running sequence."""

    def __init__(self, model, tokenizer, config: EngineConfig | None = None, context_length: int | None = None,
                 grammars: GrammarCompiler | None = None):
        self.config = config = config or EngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        self.max_model_len = config.max_model_len or context_length or model_context_length(model.config)
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        num_layers, num_kv_heads, head_dim = kv_geometry(model.config)
        per_block = PagedKVCache.bytes_per_block(num_layers, config.block_size, num_kv_heads, head_dim, model.dtype)
        self.num_kv_blocks = self._num_blocks(per_block, model.device)
        self.kv_cache_bytes = self.num_kv_blocks * per_block
        num_packed, self.linears = 0, "torch"
        on_cpu = model.device.type == "cpu"
        if on_cpu:
            keep_freed_memory()
            if config.packed_linears:
                kernel = None
                if config.linear_kernel and model.dtype == torch.float32:
                    kernel = linear_kernel(rill_cache_dir())
                num_packed, kind = pack_linears(model, kernel)
                self.linears = kind or "torch"
            kinds = sorted({m.kind for m in model.modules() if isinstance(m, (QuantLinear, FusedProjections))})
            if kinds:  # weights kept as blocks (engine/quant.py): the rest, if any, as above
                self.linears = f"{'/'.join(kinds)} blocks (C kernel)" + (f", the rest on the {self.linears}"
                                                                         if num_packed else "")
        if supports_paged_attention(model):
            kernel = None
            if on_cpu and config.decode_kernel and model.dtype == torch.float32:
                kernel = decode_attention_kernel(rill_cache_dir())
            elif model.device.type == "cuda" and config.decode_kernel:
                kernel = paged_decode_kernel(model.device)
            native = self._native_decoder(model) if on_cpu and kernel is not None and config.native_decode else None
            self.runner = PagedRunner(model, self.num_kv_blocks, config.block_size, decode_kernel=kernel, native=native,
                                      native_prefill_tokens=config.native_prefill_tokens)
            self.decode_attention = ("C (the native decode step)" if native is not None else
                                     "Triton (the paged cache in place)" if self.runner.kernel_reads_blocks else
                                     "C kernel" if kernel is not None else "torch (gathered per step)")
            log.info("engine: decode attention %s", f"in the kernel {kernel.path}" if kernel else "on the torch path")
        else:
            self.runner = FallbackRunner(model)
            self.decode_attention = "transformers' own (the fallback path)"
        self.attention_path = self.runner.path
        # the fallback path keeps its own cache per sequence: nothing there to share
        self.allocator = BlockAllocator(self.num_kv_blocks, config.block_size,
                                        prefix_caching=config.prefix_caching and self.attention_path == "paged")
        self.scheduler = Scheduler(self.allocator, config.max_num_seqs, config.max_num_batched_tokens)
        # constrained output (kept across rebuilds: the compiled grammars stay valid) and think tags
        self.grammars = grammars or GrammarCompiler(tokenizer, self.logits_width, self.eos_token_ids)
        self.think_tags = think_tags(tokenizer)
        self.sampler = Sampler(self.eos_token_ids, config.seed, self.grammars)
        self.seqs: dict[str, Sequence] = {}  # seq_id -> live sequence
        self.by_request: dict[str, list[Sequence]] = {}  # request_id -> its live sequences
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.replacement_is_final = replacement_is_final(tokenizer)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_steps = 0
        self.finished_total: Counter[str] = Counter()
        log.info("engine: %s attention path, %d KV blocks of %d tokens (%.1f MiB), max_model_len %d, "
                 "linears on %s", self.attention_path, self.num_kv_blocks, config.block_size,
                 self.kv_cache_bytes / 2**20, self.max_model_len,
                 f"the {self.linears} ({num_packed} repacked)" if num_packed else self.linears)

    @staticmethod
    def _native_decoder(model):
        """csrc/decode_layer.c for decode steps when it takes this model (engine/native.py), else None."""
        from engine.cpu import _library
        from engine.native import NativeDecoder, why_not_native

        reason = why_not_native(model)
        if reason is None:
            try:
                decoder = NativeDecoder(model, _library(rill_cache_dir())[0])
                log.info("engine: decode steps in C (csrc/decode_layer.c), one call per step")
                return decoder
            except Exception as exc:  # an old library without the symbol, ...
                reason = str(exc)
        log.info("engine: decode steps through transformers' modules (%s)", reason)
        return None

    def _num_blocks(self, per_block: int, device: torch.device) -> int:
        cfg = self.config
        if cfg.num_kv_blocks:
            return cfg.num_kv_blocks
        if cfg.kv_cache_memory:
            budget = cfg.kv_cache_memory if cfg.kv_cache_memory > 1 else cfg.kv_cache_memory * free_memory_bytes(device)
            return max(2, int(budget // per_block))
        # Enough for every running sequence at full context, capped at a quarter of free memory.
        wanted = cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size)
        return max(2, min(wanted, int(free_memory_bytes(device) * 0.25 // per_block)))

    # ---- requests -------------------------------------------------------------------------

    def check_prompt(self, prompt_token_ids: list[int], params: SamplingParams, prior_output_ids=()) -> None:
        """Raise InvalidRequest for a prompt the engine cannot serve, with the numbers."""
        if prior_output_ids and params.n != 1:
            raise InvalidRequest(f"Only a single-sample request can continue from prior output. Given: n={params.n}", "n")
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequest("The prompt is empty: it must contain at least 1 token. Given: 0 tokens", "prompt")
        vocab = self.vocab_size
        if not all(_is_token_id(t, vocab) for t in prompt_token_ids):
            position, bad = next((i, t) for i, t in enumerate(prompt_token_ids)
                                 if not _is_token_id(t, vocab))
            raise InvalidRequest(f"Prompt token ids must be integers in [0, {vocab}) (this model's vocabulary of "
                                 f"{vocab} tokens). Given: {bad!r} at position {position}.", "prompt")
        if n + params.max_tokens > self.max_model_len:
            raise InvalidRequest(
                f"The prompt ({n} tokens) plus max_tokens ({params.max_tokens}) is {n + params.max_tokens} "
                f"tokens, beyond this model's context of {self.max_model_len} tokens. Shorten the prompt "
                f"or lower max_tokens to at most {max(self.max_model_len - n, 0)}.", "max_tokens")
        capacity = self.num_kv_blocks * self.config.block_size
        if n + params.max_tokens > capacity:
            raise InvalidRequest(
                f"The prompt ({n} tokens) plus max_tokens ({params.max_tokens}) exceeds the KV cache "
                f"({capacity} tokens in all). Lower max_tokens or start the server with a larger --kv-cache-memory.",
                "max_tokens")

    @functools.cached_property
    def vocab_size(self) -> int:
        """Token ids the model can embed: [0, vocab_size)."""
        return self.model.get_input_embeddings().num_embeddings

    @functools.cached_property
    def logits_width(self) -> int:
        """Entries of a logits row: the output layer's size (padded vocabularies are wider than the tokenizer)."""
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        return int(getattr(head, "out_features", 0) or getattr(self.model.config, "vocab_size", 0) or self.vocab_size)

    def _new_detokenizer(self, params: SamplingParams, stop=None) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, params.stop if stop is None else stop,
                                      params.skip_special_tokens, self.replacement_is_final)

    def _guide(self, seq: Sequence, detok: IncrementalDetokenizer, prior_output_ids) -> None:
        """The sequence's grammar and reasoning states, replayed over output it already had."""
        params = seq.params
        if params.reasoning and self.think_tags is not None:
            seq.reasoning = ReasoningState(self.think_tags, seq.token_ids[:seq.num_prompt_tokens],
                                           params.max_reasoning_tokens, self._new_detokenizer(params, ()))
        if params.constraint is not None:
            seq.grammar = GrammarState(self.grammars.matcher(params.constraint),
                                       active=seq.reasoning is None or not seq.reasoning.thinking)
        answer = []
        for token_id in prior_output_ids:
            kind = seq.reasoning.on_token(token_id) if seq.reasoning is not None else "answer"
            if kind == "thought":
                seq.reasoning.detokenizer.add(token_id)
            elif kind == "start" and seq.grammar is not None:
                seq.grammar.active = False
            elif kind == "end":
                seq.reasoning.detokenizer.flush()  # the thought's end showed what it held
                if seq.grammar is not None:
                    seq.grammar.active = True
            elif kind == "answer":
                answer.append(token_id)
                if seq.grammar is not None and seq.grammar.active:
                    seq.grammar.accept(token_id)
        detok.prime(answer)
        if seq.reasoning is not None:
            seq.reasoning.answer_text(detok.text[:detok.emitted])  # the answer's leading space went then

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prior_output_ids: list[int] = ()) -> list[Sequence]:
        """Queue a request. `prior_output_ids` continues one whose output so far is known (a
        resumed stream): they are recomputed like a preempted sequence's, count towards
        max_tokens and min_tokens, and their text is not emitted again (n must be 1)."""
        self.check_prompt(prompt_token_ids, params, prior_output_ids)
        if request_id in self.by_request:
            raise InvalidRequest(f"Request id {request_id!r} is already running; ids must be unique.", "request_id")
        made = []  # everything is built before anything is registered: a failure leaves no trace
        for index in range(params.n):
            seq = Sequence(seq_id=f"{request_id}#{index}", request_id=request_id, index=index,
                           token_ids=list(prompt_token_ids) + list(prior_output_ids),
                           num_prompt_tokens=len(prompt_token_ids), params=params)
            detok = self._new_detokenizer(params)
            self._guide(seq, detok, list(prior_output_ids))
            made.append((seq, detok))
        for seq, detok in made:
            self.seqs[seq.seq_id] = seq
            self.detokenizers[seq.seq_id] = detok
            self.scheduler.add(seq)
        self.by_request[request_id] = seqs = [seq for seq, _ in made]
        return seqs

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT, error: str | None = None) -> list[RequestOutput]:
        """End every sequence of a request now; its KV blocks are free when this returns."""
        return [self._finish(seq, reason, error, []) for seq in list(self.by_request.get(request_id, ()))]

    def inject_fault(self, request_id: str) -> bool:
        for seq in self.by_request.get(request_id, ()):
            seq.fault = True
        return request_id in self.by_request

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def close(self) -> None:
        """Let go of the KV cache tensors (a rebuilt core allocates its own); no step after this."""
        self.runner = None

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration. A fault fails only the requests it concerns, with an error saying where
        (the engine goes on): a forward that raises is retried one sequence at a time so that only
        the sequence whose own forward raises fails; a failure in one sequence's bookkeeping,
        sampling or output processing fails that sequence. What escapes (a fault in the scheduler
        or in failing a request) leaves the engine's state unknown: the caller rebuilds it. So does
        a forward that fails for every sequence in MAX_FAILED_STEPS steps in a row (`ModelBroken`):
        then the model or its device is broken, not one request."""
        plan = self.scheduler.schedule()
        if not plan:
            return []
        self.num_steps += 1
        outputs: list[RequestOutput] = []
        logits, plan = self._forward(plan, outputs)
        if plan:
            self.num_failed_steps = 0
        else:
            self.num_failed_steps += 1
            if self.num_failed_steps >= MAX_FAILED_STEPS:
                raise ModelBroken(f"The model's forward failed for every sequence in {self.num_failed_steps} "
                                  "steps in a row; the model or its device is broken.")
        sampling: list[ScheduledChunk] = []
        for chunk in plan:
            try:
                self._advance(chunk)
            except Exception as exc:
                outputs.append(self._fail(chunk.seq, "recording the computed tokens of", exc))
                continue
            if chunk.samples:
                sampling.append(chunk)
        if sampling:
            now = time.monotonic()
            for seq, token_id, logprob in self._sample(logits, plan, sampling, outputs):
                try:
                    outputs.append(self._append_token(seq, token_id, logprob, now))
                except Exception as exc:  # e.g. a tokenizer error: this request fails alone
                    outputs.append(self._fail(seq, "detokenizing the output of", exc))
        return outputs

    num_failed_steps = 0  # consecutive steps whose forward failed for every sequence

    def _fail(self, seq: Sequence, stage: str, exc: BaseException) -> RequestOutput:
        """Finish `seq` with an error naming the stage that failed; the traceback goes to the log."""
        log.error("%s failed for %s", stage, seq.seq_id, exc_info=exc)
        return self._finish(seq, FinishReason.ERROR,
                            f"The engine failed while {stage} this request; "
                            "the other requests were not affected. The server log has the details.", [])

    def _forward(self, plan: list[ScheduledChunk], outputs: list[RequestOutput]):
        """(logits [sampling chunks of the kept plan, vocab], the kept plan). When the batch's
        forward raises, each chunk runs alone: the ones that still raise fail, the rest go on.
        A failed forward leaves nothing a later one depends on (the paged cache's slots are
        written again; the fallback runner rolls its caches back), so the retry computes the
        same K/V and logits as an answer computed alone."""
        try:
            return self.runner.run(plan), plan
        except Exception as exc:
            if len(plan) == 1:
                outputs.append(self._fail(plan[0].seq, "running the model on", exc))
                return None, []
            log.warning("a forward of %d sequences failed (%s: %s); running them one at a time",
                        len(plan), type(exc).__name__, exc)
        kept, rows = [], []
        for chunk in plan:
            try:
                logits = self.runner.run([chunk])
            except Exception as exc:
                outputs.append(self._fail(chunk.seq, "running the model on", exc))
                continue
            kept.append(chunk)
            if chunk.samples:
                rows.append(logits)
        return (torch.cat(rows) if rows else None), kept

    def _advance(self, chunk: ScheduledChunk) -> None:
        """After the forward: the chunk's tokens are computed; name the blocks they filled."""
        seq = chunk.seq
        seq.num_computed_tokens += chunk.num_tokens
        # prompt tokens this chunk computes for the first time (not cached, not recomputed)
        first_new = max(seq.num_prompt_tokens_computed, chunk.start)
        prompt_end = min(seq.num_computed_tokens, seq.num_prompt_tokens)
        if prompt_end > first_new:
            self.prompt_tokens_total += prompt_end - first_new
        seq.num_prompt_tokens_computed = max(seq.num_prompt_tokens_computed, prompt_end)
        seq.num_cached_blocks = self.allocator.cache_full_blocks(
            seq.token_ids, seq.block_hashes, seq.block_table, seq.num_computed_tokens, seq.num_cached_blocks,
            seq.params.cache_salt)

    def _sample(self, logits: torch.Tensor, plan: list[ScheduledChunk], sampling: list[ScheduledChunk],
                outputs: list[RequestOutput]) -> list[tuple[Sequence, int, object]]:
        """(seq, token id, logprob) of each sampling chunk still alive; a row whose logits are not
        finite fails. When the batched sampling raises, each row samples alone."""
        # logits has one row per sampling chunk of `plan`; keep those whose chunk was not failed since
        sampling_rows = {id(c): row for row, c in enumerate(c for c in plan if c.samples)}
        index = [sampling_rows[id(c)] for c in sampling]
        if len(index) != logits.shape[0]:
            logits = logit_rows(logits, index)
        seqs = [c.seq for c in sampling]
        try:
            results = [(self.sampler.sample(logits, seqs), range(len(seqs)))]
        except Exception as exc:
            log.warning("sampling %d sequences failed (%s: %s); sampling them one at a time",
                        len(seqs), type(exc).__name__, exc)
            results = []
            for row, seq in enumerate(seqs):
                try:
                    results.append((self.sampler.sample(logit_rows(logits, slice(row, row + 1)), [seq]), [row]))
                except Exception as exc:
                    outputs.append(self._fail(seq, "sampling the next token of", exc))
        sampled = []
        for result, rows in results:
            bad = set(result.bad_rows)
            for i, row in enumerate(rows):
                seq = seqs[row]
                if i in bad:
                    outputs.append(self._finish(seq, FinishReason.ERROR,
                                                "The model produced non-finite (NaN or inf) logits for this request.", []))
                else:
                    sampled.append((seq, result.token_ids[i], result.logprobs[i]))
        return sampled

    def _append_token(self, seq: Sequence, token_id: int, logprob, now: float) -> RequestOutput:
        params = seq.params
        seq.token_ids.append(token_id)
        self.generation_tokens_total += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        logprobs = [logprob] if logprob is not None else None
        num_out = seq.num_output_tokens
        grammar, reasoning = seq.grammar, seq.reasoning
        constrained = grammar is not None and grammar.active
        reason = None
        text = thought = ""
        if ((token_id in self.eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids) \
                and (num_out >= params.min_tokens or constrained):
            reason = FinishReason.STOP  # the EOS / stop token is kept in token_ids, not in the text
        else:
            kind = reasoning.on_token(token_id) if reasoning is not None else "answer"
            if kind == "thought":
                thought = reasoning.detokenizer.add(token_id)
            elif kind == "start" and grammar is not None:
                grammar.active = False  # the model opened a thought: free text until it ends
            elif kind == "end":
                thought = reasoning.detokenizer.flush()
                if grammar is not None:
                    grammar.active = True  # the constraint applies to the answer, after the thought
            elif kind == "answer":
                if constrained and not grammar.accept(token_id):
                    return self._finish(seq, FinishReason.ERROR, f"The constraint rejected token {token_id}: "
                                        f"{grammar.error}", [token_id], logprobs=logprobs)
                detok = self.detokenizers[seq.seq_id]
                text = detok.add(token_id)
                if reasoning is not None:
                    text = reasoning.answer_text(text)
                if detok.stopped or (constrained and grammar.complete):
                    reason = FinishReason.STOP  # a stop string, or the grammar is complete
        if reason is None and (num_out >= params.max_tokens or len(seq.token_ids) >= self.max_model_len):
            reason = FinishReason.LENGTH
        if reason is not None:
            return self._finish(seq, reason, None, [token_id], text, logprobs, thought)
        return RequestOutput(seq.request_id, seq.index, [token_id], text, logprobs=logprobs,
                             num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=num_out,
                             first_token_time=seq.first_token_time, arrival_time=seq.arrival_time,
                             scheduled_time=seq.scheduled_time, reasoning=thought)

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None, token_ids: list[int],
                text: str = "", logprobs=None, thought: str = "") -> RequestOutput:
        if seq.status is not RequestStatus.FINISHED:
            self.scheduler.finish(seq)
        self.runner.free(seq.seq_id)
        self.sampler.forget(seq.seq_id)
        detok = self.detokenizers.pop(seq.seq_id, None)
        # An error or an abort shows nothing that was held back: a resumed stream's continuation
        # holds it again and releases it in context (`IncrementalDetokenizer.prime`).
        if detok is not None and reason not in (FinishReason.ERROR, FinishReason.ABORT):
            text += detok.flush()
            if seq.reasoning is not None:
                text = seq.reasoning.answer_text(text)
                if seq.reasoning.thinking:  # ended inside the thought: what it held back is thought
                    thought += seq.reasoning.detokenizer.flush()
        seq.finish_reason = reason
        seq.error = error
        self.seqs.pop(seq.seq_id, None)
        siblings = self.by_request.get(seq.request_id)
        if siblings is not None:
            siblings.remove(seq)
            if not siblings:
                del self.by_request[seq.request_id]
        self.finished_total[reason.value] += 1
        return RequestOutput(seq.request_id, seq.index, token_ids, text, finished=True, finish_reason=reason,
                             logprobs=logprobs, num_prompt_tokens=seq.num_prompt_tokens,
                             num_output_tokens=seq.num_output_tokens, error=error,
                             first_token_time=seq.first_token_time, arrival_time=seq.arrival_time,
                             scheduled_time=seq.scheduled_time, reasoning=thought)

    def stats(self, num_pending: int = 0) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + num_pending,
            kv_usage=self.allocator.usage,
            num_kv_blocks=self.num_kv_blocks,
            num_free_kv_blocks=self.allocator.num_free,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_steps=self.num_steps,
            finished_total=dict(self.finished_total),
            prefix_cache_queried_tokens=self.allocator.queried_tokens,
            prefix_cache_hit_tokens=self.allocator.hit_tokens,
        )
