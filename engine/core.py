"""The synchronous engine step: schedule -> run -> postprocess. No threads, no asyncio.

    plan = self._schedule()  # the scheduler's chunks (with speculation, drafts proposed first)
    step, plan = self._run(plan, outputs)  # the runner's StepOutput: the sampling rows' logits (and argmax)
    self._postprocess(plan, step, outputs)  # tokens recorded; sampled (or drafts verified); then stop,
                                            # reasoning, grammar, detokenize (engine/output.py)
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from dataclasses import dataclass, field


from engine.attention import PagedKVCache, kv_cache_dtype
from engine.config import EngineConfig
from engine.grammar import GrammarCompiler
from engine.kv_cache import BlockAllocator
from engine.model.memory import num_kv_blocks
from engine.model.setup import setup_model
from engine.output import OutputProcessor
from engine.request import (
    FinishReason,
    InvalidRequest,
    RequestOutput,
    RequestStatus,
    SamplingParams,
    Sequence,
)
from engine.runner.paged import kv_geometry
from engine.runner.step_output import StepOutput
from engine.sampler import Sampler
from engine.scheduler import ScheduledChunk, Scheduler
from engine.model.facts import eos_token_ids, model_context_length
from engine.speculative import make_speculator, merge_outputs

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
    spec_draft_tokens: int = 0  # guessed tokens verified (engine/speculative.py)
    spec_accepted_tokens: int = 0  # of which the model agreed with (each a token without a step of its own)


def _is_token_id(value, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


MAX_FAILED_STEPS = 3  # steps in a row whose forward fails for every sequence: the model is broken


class ModelBroken(RuntimeError):
    """The forward failed for every sequence of several steps in a row: the engine must die
    (and be rebuilt, within its max_restarts), since no request can be served."""


class EngineCore:
    """Owns the model, the KV cache and the queues; `step()` advances every running sequence."""

    def __init__(self, model, tokenizer, config: EngineConfig | None = None, context_length: int | None = None,
                 grammars: GrammarCompiler | None = None, draft=None, vision=None):
        self.config = config = config or EngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        self.max_model_len = config.max_model_len or context_length or model_context_length(model.config)
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        num_layers, num_kv_heads, head_dim = kv_geometry(model.config)
        self.kv_cache_dtype = kv_cache_dtype(config.kv_cache_dtype, model.dtype)  # what the KV pool holds
        per_block = PagedKVCache.bytes_per_block(num_layers, config.block_size, num_kv_heads, head_dim,
                                                 self.kv_cache_dtype)
        # sized before the model's linears are packed, from what the device has free now
        self.num_kv_blocks = num_kv_blocks(config, self.max_model_len, per_block, model.device)
        self.kv_cache_bytes = self.num_kv_blocks * per_block
        setup = setup_model(model, config, self.num_kv_blocks)
        self.runner = setup.runner
        self.linears = setup.linears  # a label: where the linears run (read from the model's modules)
        self.decode_attention = setup.decode_attention  # a label: where decode attention runs
        self.attention_path = self.runner.path
        self.runner_reason = setup.runner_reason  # why the fallback runner (None: the paged path, verified at load)
        # engine.model.vision.ImageEncoder of a vision-language model: the paged runner merges its features
        self.vision = vision if self.attention_path == "paged" else None
        if self.vision is not None:
            self.runner.encoder = vision
        # the fallback path keeps its own cache per sequence: nothing there to share
        self.allocator = BlockAllocator(self.num_kv_blocks, config.block_size,
                                        prefix_caching=config.prefix_caching and self.attention_path == "paged")
        self.scheduler = Scheduler(self.allocator, config.max_num_seqs, config.max_num_batched_tokens)
        # constrained output (kept across rebuilds: the compiled grammars stay valid) and think tags
        self.grammars = grammars or GrammarCompiler(tokenizer, self.logits_width, self.eos_token_ids)
        self.output = OutputProcessor(tokenizer, self.eos_token_ids, self.max_model_len, self.grammars)
        self.think_tags = self.output.think_tags
        self.sampler = Sampler(self.eos_token_ids, config.seed, self.grammars)
        # drafts need the paged cache, whose positions past the accepted ones are simply written again;
        # `draft`: the loaded draft model of speculative="draft" (engine/draft.py)
        self.speculator = make_speculator(config, draft, self.max_model_len, self.vocab_size) \
            if self.attention_path == "paged" else None
        self.seqs: dict[str, Sequence] = {}  # seq_id -> live sequence
        self.by_request: dict[str, list[Sequence]] = {}  # request_id -> its live sequences
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_steps = 0
        self.finished_total: Counter[str] = Counter()
        log.info("engine: %s attention path, %d KV blocks of %d tokens (%.1f MiB), max_model_len %d, "
                 "linears on %s", self.attention_path, self.num_kv_blocks, config.block_size,
                 self.kv_cache_bytes / 2**20, self.max_model_len,
                 f"the {self.linears} ({setup.num_packed} repacked)" if setup.num_packed else self.linears)

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

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prior_output_ids: list[int] = (), client=None, checked: bool = False,
                    images=None) -> list[Sequence]:
        """Queue a request. `prior_output_ids` continues one whose output so far is known (a
        resumed stream): they are recomputed like a preempted sequence's, count towards
        max_tokens and min_tokens, and their text is not emitted again (n must be 1). `client`:
        whose it is, for the scheduler's fair shares (None: the anonymous client). `checked`: the
        caller ran `check_prompt` on these already (AsyncEngine does, before it answers). `images`:
        the prompt's `PromptImages` (engine/model/vision.py), made by this model's `ImageEncoder`."""
        if not checked:
            self.check_prompt(prompt_token_ids, params, prior_output_ids)
        if images is not None and self.vision is None:
            raise InvalidRequest("This model takes text only: a request with images cannot be served.", "messages")
        if request_id in self.by_request:
            raise InvalidRequest(f"Request id {request_id!r} is already running; ids must be unique.", "request_id")
        made = []  # everything is built before anything is registered: a failure leaves no trace
        for index in range(params.n):
            seq = Sequence(seq_id=f"{request_id}#{index}", request_id=request_id, index=index,
                           token_ids=list(prompt_token_ids) + list(prior_output_ids),
                           num_prompt_tokens=len(prompt_token_ids), params=params, client=client, images=images)
            made.append((seq, self.output.prepare(seq, list(prior_output_ids))))
        for seq, detok in made:
            self.seqs[seq.seq_id] = seq
            self.output.add(seq, detok)
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
        if self.speculator is not None:
            self.speculator.close()

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration. A fault fails only the requests it concerns, with an error saying where
        (the engine goes on): a forward that raises is retried one sequence at a time so that only
        the sequence whose own forward raises fails; a failure in one sequence's bookkeeping,
        sampling or output processing fails that sequence. What escapes (a fault in the scheduler
        or in failing a request) leaves the engine's state unknown: the caller rebuilds it. So does
        a forward that fails for every sequence in MAX_FAILED_STEPS steps in a row (`ModelBroken`):
        then the model or its device is broken, not one request."""
        plan = self._schedule()
        if not plan:
            return []
        outputs: list[RequestOutput] = []  # this step's deltas, the failed requests' ends among them
        step, plan = self._run(plan, outputs)
        self._postprocess(plan, step, outputs)
        return outputs

    def _schedule(self) -> list[ScheduledChunk]:
        """The step's chunks; with speculation, drafts proposed before the schedule and a draft
        model's prompts computed after it."""
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self.max_model_len)
        plan = self.scheduler.schedule()
        if plan:
            if self.speculator is not None:
                self.speculator.scheduled(plan)
            self.num_steps += 1
        return plan

    num_failed_steps = 0  # consecutive steps whose forward failed for every sequence

    def _run(self, plan: list[ScheduledChunk], outputs: list[RequestOutput]):
        """(StepOutput, the chunks whose forward ran): `_forward`, and `ModelBroken` once it failed
        for every sequence in MAX_FAILED_STEPS steps in a row."""
        step, plan = self._forward(plan, outputs)
        self.num_failed_steps = 0 if plan else self.num_failed_steps + 1
        if self.num_failed_steps >= MAX_FAILED_STEPS:
            raise ModelBroken(f"The model's forward failed for every sequence in {self.num_failed_steps} "
                              "steps in a row; the model or its device is broken.")
        return step, plan

    def _postprocess(self, plan: list[ScheduledChunk], step: StepOutput | None,
                     outputs: list[RequestOutput]) -> None:
        """Each chunk's computed tokens recorded; each sampling chunk's next token sampled, or its
        draft verified (speculative decoding), through the output state machine."""
        sampling = self._advance_all(plan, outputs)
        if not sampling:
            return
        now, first_row = time.monotonic(), _first_rows(plan)  # the step's rows of each sampling chunk start there
        self._append_sampled(step, [c for c in sampling if not c.draft], first_row, now, outputs)
        self._verify_drafts(step, [c for c in sampling if c.draft], first_row, now, outputs)

    def _advance_all(self, plan: list[ScheduledChunk], outputs: list[RequestOutput]) -> list[ScheduledChunk]:
        """`_advance` for every chunk (one that fails fails its request); returns the sampling ones."""
        sampling = []
        for chunk in plan:
            try:
                self._advance(chunk)
            except Exception as exc:
                outputs.append(self._fail(chunk.seq, "recording the computed tokens of", exc))
                continue
            if chunk.samples:
                sampling.append(chunk)
        return sampling

    def _append_sampled(self, step: StepOutput, plain: list[ScheduledChunk], first_row: dict[int, int], now: float,
                        outputs: list[RequestOutput]) -> None:
        """The next token of each chunk without a draft, sampled from its row and appended."""
        for seq, token_id, logprob in self._sample(step, [first_row[id(c)] for c in plain], plain, outputs):
            try:
                outputs.append(self._append_token(seq, token_id, logprob, now))
            except Exception as exc:  # e.g. a tokenizer error: this request fails alone
                outputs.append(self._fail(seq, "detokenizing the output of", exc))

    def _verify_drafts(self, step: StepOutput, drafted: list[ScheduledChunk], first_row: dict[int, int], now: float,
                       outputs: list[RequestOutput]) -> None:
        """Each drafted chunk's draft checked against its rows (one more than the draft's tokens)."""
        for chunk in drafted:
            row = first_row[id(chunk)]
            outputs.append(self._verify(chunk, step.rows(slice(row, row + 1 + len(chunk.draft))), now))

    def _fail(self, seq: Sequence, stage: str, exc: BaseException) -> RequestOutput:
        """Finish `seq` with an error naming the stage that failed; the traceback goes to the log."""
        log.error("%s failed for %s", stage, seq.seq_id, exc_info=exc)
        return self._finish(seq, FinishReason.ERROR,
                            f"The engine failed while {stage} this request; "
                            "the other requests were not affected. The server log has the details.", [])

    def _forward(self, plan: list[ScheduledChunk], outputs: list[RequestOutput]):
        """(StepOutput of the sampling chunks of the kept plan, the kept plan). When the batch's
        forward raises, each chunk runs alone: the ones that still raise fail, the rest go on.
        A failed forward leaves nothing a later one depends on (the paged cache's slots are
        written again; the fallback runner rolls its caches back), so the retry computes the
        same K/V and logits as an answer computed alone."""
        try:
            return StepOutput.of(self.runner.run(plan)), plan
        except Exception as exc:
            if len(plan) == 1:
                outputs.append(self._fail(plan[0].seq, "running the model on", exc))
                return None, []
            log.warning("a forward of %d sequences failed (%s: %s); running them one at a time",
                        len(plan), type(exc).__name__, exc)
        kept, rows = [], []
        for chunk in plan:
            try:
                step = StepOutput.of(self.runner.run([chunk]))
            except Exception as exc:
                outputs.append(self._fail(chunk.seq, "running the model on", exc))
                continue
            kept.append(chunk)
            if chunk.samples:
                rows.append(step)
        return (StepOutput.cat(rows) if rows else None), kept

    def _advance(self, chunk: ScheduledChunk) -> None:
        """After the forward: the chunk's tokens are computed; name the blocks they filled."""
        seq = chunk.seq
        seq.num_computed_tokens += chunk.num_tokens - len(chunk.draft)  # a draft's count once verified
        # prompt tokens this chunk computes for the first time (not cached, not recomputed)
        first_new = max(seq.num_prompt_tokens_computed, chunk.start)
        prompt_end = min(seq.num_computed_tokens, seq.num_prompt_tokens)
        if prompt_end > first_new:
            self.prompt_tokens_total += prompt_end - first_new
        seq.num_prompt_tokens_computed = max(seq.num_prompt_tokens_computed, prompt_end)
        seq.num_cached_blocks = self.allocator.cache_full_blocks(
            seq.token_ids, seq.block_hashes, seq.block_table, seq.num_computed_tokens, seq.num_cached_blocks,
            seq.params.cache_salt, seq.images)
        if seq.image_features is not None and seq.num_computed_tokens > seq.images.last:
            seq.image_features = None  # every image position is in the KV cache now

    def _sample(self, step: StepOutput, index: list[int], sampling: list[ScheduledChunk],
                outputs: list[RequestOutput]) -> list[tuple[Sequence, int, object]]:
        """(seq, token id, logprob) of each sampling chunk still alive (its row of `step`: `index`);
        a row whose logits are not finite fails. When the batched sampling raises, each row samples alone."""
        if not sampling:
            return []
        if len(index) != len(step.logits):
            step = step.rows(index)
        seqs = [c.seq for c in sampling]
        try:
            results = [(self.sampler.sample(step, seqs), range(len(seqs)))]
        except Exception as exc:
            log.warning("sampling %d sequences failed (%s: %s); sampling them one at a time",
                        len(seqs), type(exc).__name__, exc)
            results = []
            for row, seq in enumerate(seqs):
                try:
                    results.append((self.sampler.sample(step.rows(slice(row, row + 1)), [seq]), [row]))
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

    def _verify(self, chunk: ScheduledChunk, step: StepOutput, now: float) -> RequestOutput:
        """The tokens a chunk's verified draft adds (engine/speculative.py), one at a time through
        the output state machine (the first that finishes the sequence drops the rest), in one delta."""
        seq = chunk.seq
        try:
            tokens = self.speculator.verify(step, seq, chunk.draft, self.sampler)
        except Exception as exc:
            return self._fail(seq, "sampling the next token of", exc)
        if tokens is None:
            return self._finish(seq, FinishReason.ERROR,
                                "The model produced non-finite (NaN or inf) logits for this request.", [])
        deltas = []
        try:
            for token_id in tokens:
                deltas.append(self._append_token(seq, token_id, None, now))
                if deltas[-1].finished:
                    return merge_outputs(deltas)
            self.speculator.settle(seq, len(tokens) - 1, self.allocator)
        except Exception as exc:  # e.g. a tokenizer error: this request fails alone
            return self._fail(seq, "detokenizing the output of", exc)
        return merge_outputs(deltas)

    def _append_token(self, seq: Sequence, token_id: int, logprob, now: float) -> RequestOutput:
        seq.token_ids.append(token_id)
        self.generation_tokens_total += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        logprobs = [logprob] if logprob is not None else None
        out = self.output.on_token(seq, token_id)
        if out.finish_reason is not None:
            return self._finish(seq, out.finish_reason, out.error, [token_id], out.text, logprobs, out.thought)
        return RequestOutput(seq.request_id, seq.index, [token_id], out.text, logprobs=logprobs,
                             num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_output_tokens,
                             first_token_time=seq.first_token_time, arrival_time=seq.arrival_time,
                             scheduled_time=seq.scheduled_time, reasoning=out.thought)

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None, token_ids: list[int],
                text: str = "", logprobs=None, thought: str = "") -> RequestOutput:
        if seq.status is not RequestStatus.FINISHED:
            self.scheduler.finish(seq)
        self.runner.free(seq.seq_id)
        self.sampler.forget(seq.seq_id)
        if self.speculator is not None:
            self.speculator.forget(seq.seq_id)
        text, thought = self.output.finish(seq, reason, text, thought)
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
            spec_draft_tokens=self.speculator.draft_tokens_total if self.speculator else 0,
            spec_accepted_tokens=self.speculator.accepted_tokens_total if self.speculator else 0,
        )


def _first_rows(plan: list[ScheduledChunk]) -> dict[int, int]:
    """id(chunk) -> its first row in the step's output: one row per sampling chunk, and one more
    for each token of its draft."""
    rows, row = {}, 0
    for chunk in plan:
        if chunk.samples:
            rows[id(chunk)] = row
            row += 1 + len(chunk.draft)
    return rows
