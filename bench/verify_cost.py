"""What a speculative step costs against the number of guesses it checks, on any model: the guesses
are always right (the model's own greedy answer, computed first, is fed back as the proposal), so
each setting's step count is known and its speed is the upper bound of speculation at that k.

    python -m bench.verify_cost [--model M] [--ks 0,1,2,4,6,8] [--max-tokens 128] [--prompt-tokens 500]

The embedded SmolLM2-135M by default; a large random-weight GGUF of a real shape works the same
(`--model ~/.cache/rill/bench-smollm2-1.7b-q4_k_m-v1.gguf`, written by `python -m bench.peers
large`): random weights cannot show how often real guesses are right, but the step costs are the
model's. One request at a time on the engine alone (greedy), a prompt of --prompt-tokens tokens of
bench/data/apache-2.0.txt. Prints, per k: ms per step, tokens per second, and both over k = 0.
"""

from __future__ import annotations

import argparse

from bench.speculative import TEXT, run_one
from engine import EngineConfig
from engine.core import EngineCore
from engine.model.loading import load_model
from engine.speculative import Speculator


class Oracle(Speculator):
    """A speculator whose n-gram guesses are replaced by the known answer's next k tokens."""

    def __init__(self, k: int, answer: list[int], prompt_len: int):
        super().__init__(k, max_running=1)
        self.answer, self.prompt_len = answer, prompt_len

    def propose(self, running, max_model_len: int) -> None:
        for seq in running:
            k = self._length(seq, max_model_len)  # the speculator's own length rule (room left, k)
            done = len(seq.token_ids) - self.prompt_len
            seq.draft_token_ids = self.answer[done:done + k] if k else []


def timed_steps(core: EngineCore, prompt: list[int], answer: list[int], k: int, rounds: int
                ) -> tuple[list[tuple[float, int]], list[int]]:
    """`rounds` runs of `prompt` with always-right guesses of k tokens (k = 0: no speculation):
    each run's (decode seconds, steps after the first token), and the last run's tokens. The core's
    speculator is left as the runs had it."""
    core.speculator = Oracle(k, answer, len(prompt)) if k else None
    timings, tokens = [], []
    for _ in range(rounds):
        tokens, seconds, _, accepted = run_one(core, prompt, len(answer))
        timings.append((seconds, len(tokens) - 1 - accepted))  # each step after the first: 1 + its accepted
    return timings, tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.verify_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    parser.add_argument("--ks", default="0,1,2,4,6,8", help="guesses per step to time (0: no speculation)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=2, help="runs per k (the median's ms per step is kept)")
    args = parser.parse_args(argv)
    ks = [int(k) for k in args.ks.split(",")]
    if any(k < 0 for k in ks):
        parser.error(f"--ks: each at least 0, given {args.ks}")
    loaded = load_model(args.model)
    tok = loaded.tokenizer
    prompt = tok.encode(TEXT.read_text(), add_special_tokens=False)[:args.prompt_tokens]
    core = EngineCore(loaded.model, tok, EngineConfig(), loaded.context_length)
    answer = run_one(core, prompt, args.max_tokens)[0]  # also the warm-up
    print(f"model {args.model or 'embedded SmolLM2-135M'}, prompt {len(prompt)} tokens, {len(answer)} out, "
          f"always-right guesses, one request, greedy")
    print(f"{'k':>3} {'steps':>6} {'ms/step':>8} {'tok/s':>8} {'step x k=0':>10} {'speed x k=0':>11} same")
    base = None
    for k in ks:
        timings, tokens = timed_steps(core, prompt, answer, k, args.rounds)
        seconds, steps = sorted(timings)[len(timings) // 2]
        ms, speed = seconds / max(steps, 1) * 1e3, (len(tokens) - 1) / seconds
        base = base or (ms, speed)
        print(f"{k:3d} {steps:6d} {ms:8.2f} {speed:8.1f} {ms / base[0]:9.2f}x {speed / base[1]:10.2f}x "
              f"{'yes' if tokens == answer else 'NO'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
