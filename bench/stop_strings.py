"""Does one request with hostile stop strings slow the other streams down?

    python -m bench.stop_strings [--model DIR] [--tokens 40] [--rounds 3]

One greedy stream (the victim) is timed token by token: alone, then beside a request with `n` at
its maximum (16) and no stops (what batching 16 more samples costs), then beside the same request
with the maximum number of the longest allowed stops (16 x 256 characters), matched by the
engine's automaton, and last beside that request matched by the matcher rill had before (a
quadratic scan of every stop's prefixes per token, kept here as the baseline). Prints the
victim's inter-token latency in each case and its ratio to the stream alone; the target is the
hostile request within 1.5x. The stops are runs of the character the model emits most, so
their prefixes keep matching. The four cases run in turn, `--rounds` times, so that a change
in the machine's load falls on all of them alike. Without `--model` it uses the benchmark Llama
(bench/model.py, built once); `--model tiny` builds the tests' tiny random Llama, whose forward
is so cheap that any per-token cost beside the model shows.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.detokenizer import IncrementalDetokenizer
from engine.model.loading import load_model
from engine.request import MAX_N, MAX_STOP_LENGTH, MAX_STOP_STRINGS

PROMPT = "Once upon a time, in a land far away, there lived"


def quadratic_release(self, final: bool) -> str:
    """The baseline: IncrementalDetokenizer._release as it was before the automaton."""
    if self.stop and not self.stopped:
        longest = max(len(s) for s in self.stop)
        search_from = max(0, self.emitted - longest)
        hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True
    end = len(self.text)
    if self.stop and not self.stopped and not final:
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        end -= best
    delta = self.text[self.emitted:end] if end > self.emitted else ""
    self.emitted = max(self.emitted, end)
    return delta


async def victim_gaps(engine: AsyncEngine, prompt_ids: list[int], tokens: int) -> list[float]:
    """Seconds between consecutive tokens of one greedy stream."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    arrivals = []
    async for out in engine.generate(prompt_ids, params):
        arrivals.extend([time.perf_counter()] * len(out.token_ids))
    return [later - earlier for earlier, later in zip(arrivals, arrivals[1:])]


async def beside(engine: AsyncEngine, prompt_ids: list[int], tokens: int, hostile: SamplingParams | None) -> list[float]:
    """The victim's gaps while `hostile` (None: nothing) runs; the hostile request starts first."""
    if hostile is None:
        return await victim_gaps(engine, prompt_ids, tokens)
    stream = engine.add_request(prompt_ids, hostile)
    first = await stream.next()  # it runs (its samples are in the batch) before the victim starts
    assert first is not None and not first.finished, "the hostile request ended before the victim started"

    async def drain():
        async for _ in stream:
            pass

    reader = asyncio.ensure_future(drain())
    try:
        gaps = await victim_gaps(engine, prompt_ids, tokens)
        assert not stream.done, "the hostile request ended while the victim was timed; raise its max_tokens"
        return gaps
    finally:
        engine.abort(stream.request_id)
        await reader


def most_common_character(engine: AsyncEngine, prompt_ids: list[int]) -> str:
    async def sample():
        text = []
        params = SamplingParams(max_tokens=64, temperature=1.0, seed=0, ignore_eos=True, n=4)
        async for out in engine.generate(prompt_ids, params):
            text.append(out.text)
        return "".join(text)
    counts = Counter(ch for ch in asyncio.run(sample()) if not ch.isspace())
    return counts.most_common(1)[0][0] if counts else "a"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model folder, or `tiny` (default: the benchmark Llama)")
    parser.add_argument("--tokens", type=int, default=40, help="tokens the victim stream is timed over, per round")
    parser.add_argument("--rounds", type=int, default=3, help="times each case runs, in turn with the others")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    args = parser.parse_args(argv)
    if args.model == "tiny":
        from tests.tiny_models import TINY_VOCAB, build_tiny_model, build_tokenizer
        model_dir = build_tiny_model("llama", Path(tempfile.mkdtemp(prefix="rill-bench-stops-")) / "llama",
                                     tokenizer=build_tokenizer(TINY_VOCAB))
    elif args.model:
        model_dir = Path(args.model)
    else:
        from bench.model import ensure_bench_model
        model_dir = ensure_bench_model()
    engine = AsyncEngine(load_model(str(model_dir), device=args.device), EngineConfig(max_num_seqs=32)).start()
    try:
        prompt_ids = engine.encode(PROMPT)
        ch = most_common_character(engine, prompt_ids)
        stops = tuple(ch * (MAX_STOP_LENGTH - 1) + chr(0x2460 + i) for i in range(MAX_STOP_STRINGS))
        room = engine.max_model_len - len(prompt_ids) - 1
        hostile_tokens = min(room, args.tokens * 4)  # outlives the victim
        common = dict(max_tokens=hostile_tokens, temperature=1.0, seed=1, ignore_eos=True, n=MAX_N)
        cases = [("alone", None, False),
                 (f"beside n={MAX_N}, no stops", SamplingParams(**common), False),
                 (f"beside n={MAX_N}, {MAX_STOP_STRINGS} stops x {MAX_STOP_LENGTH} chars", SamplingParams(**common, stop=stops), False),
                 ("same, baseline quadratic matcher", SamplingParams(**common, stop=stops), True)]

        async def run_all():
            await victim_gaps(engine, prompt_ids, 16)  # warm-up
            results = [(name, []) for name, _, _ in cases]
            for _ in range(args.rounds):
                for (name, hostile, quadratic), (_, gaps) in zip(cases, results):
                    original = IncrementalDetokenizer._release
                    if quadratic:
                        IncrementalDetokenizer._release = quadratic_release
                    try:
                        gaps.extend(await beside(engine, prompt_ids, args.tokens, hostile))
                    finally:
                        IncrementalDetokenizer._release = original
            return results

        results = asyncio.run(run_all())
    finally:
        engine.shutdown()
    alone = statistics.median(results[0][1])
    print(f"model: {model_dir}  victim: {args.rounds} x {args.tokens} greedy tokens  stops: runs of {ch!r}")
    print(f"{'victim stream':<46} {'median ITL':>11} {'mean ITL':>10} {'ratio':>7}")
    for name, gaps in results:
        median = statistics.median(gaps)
        print(f"{name:<46} {median * 1000:>8.2f} ms {statistics.mean(gaps) * 1000:>7.2f} ms {median / alone:>6.2f}x")
    batched, hostile = (statistics.median(results[i][1]) for i in (1, 2))
    print(f"beside the hostile request: {hostile / alone:.2f}x alone (target 1.5x), of which batching its {MAX_N} "
          f"samples {batched / alone:.2f}x and matching its stops {hostile / batched:.2f}x")


if __name__ == "__main__":
    main()
