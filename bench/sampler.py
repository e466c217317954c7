"""The batched sampler alone: milliseconds per step for greedy and sampled rows at 1 and 32 rows over
the embedded model's vocabulary (49,152), random logits of a chat model's spread, on the C kernel
(engine/kernels/sampling.py) and on the numpy reference it replaces.

    python -m bench.sampler [--repeat 30] [--step]

Greedy is the engine's case: the step hands over each row's argmax with the logits. `--step` also
times the embedded model's decode step (greedy, the engine alone, 1 and 32 sequences) and prints
each sampled setting's cost as a share of that step (figures: docs/benchmarks-history.md).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from engine.request import SamplingParams, Sequence
from engine.runner.step_output import StepOutput
from engine.sampler import Sampler

VOCAB = 49152
ROWS = (1, 32)
SETTINGS = {
    "greedy": dict(temperature=0),
    "temperature 1": dict(temperature=1.0),
    "temperature 0.7, top_p 0.9, top_k 50, penalties": dict(temperature=0.7, top_p=0.9, top_k=50,
                                                            repetition_penalty=1.1, frequency_penalty=0.2),
}


def _timed(fn, repeat: int) -> float:
    """The lower quartile of `repeat` calls of fn, in milliseconds (a shared host's noise only adds)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 4] * 1000


def sampler_costs(repeat: int) -> dict[str, dict[str, float]]:
    """path -> "setting xrows" -> ms per step."""
    gen = torch.Generator().manual_seed(0)
    samplers = {"C kernel": Sampler([0]), "numpy reference": Sampler([0], use_kernel=False)}
    if samplers["C kernel"].kernel is None:
        raise SystemExit("the sampling kernel is unavailable here (see the log)")
    results: dict[str, dict[str, float]] = {path: {} for path in samplers}
    for name, params in SETTINGS.items():
        for rows in ROWS:
            prompt = list(range(300))  # penalties read a 300-token prompt and a 100-token output
            seqs = [Sequence(f"s{i}", "r", 0, prompt + list(range(1000, 1100)), 300,
                             SamplingParams(max_tokens=512, **params)) for i in range(rows)]
            logits = torch.randn(rows, VOCAB, generator=gen) * 3
            step = StepOutput(logits, logits.argmax(dim=1))
            for path, sampler in samplers.items():
                reps = repeat if path == "C kernel" or rows == 1 else max(3, repeat // 10)
                results[path][f"{name} x{rows}"] = round(_timed(lambda: sampler.sample(step, seqs), reps), 3)
    return results


def step_costs(steps: int = 24) -> dict[int, float]:
    """rows -> the embedded model's median greedy decode step in ms (the engine alone)."""
    from engine import EngineConfig
    from engine.core import EngineCore
    from engine.model.loading import load_model

    loaded = load_model(None)
    core = EngineCore(loaded.model, loaded.tokenizer, EngineConfig(), loaded.context_length)
    prompt = loaded.tokenizer.encode("The history of the printing press begins", add_special_tokens=False)
    out = {}
    for rows in ROWS:
        for i in range(rows):
            core.add_request(f"step-{rows}-{i}", prompt, SamplingParams(max_tokens=steps + 4, temperature=0,
                                                                          ignore_eos=True))
        times = []
        while core.has_work():
            start = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - start)
        decode = sorted(times[2:-2])
        out[rows] = round(decode[len(decode) // 2] * 1000, 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--step", action="store_true", help="also time the embedded model's greedy decode step")
    args = parser.parse_args()
    report = {"ms_per_step": sampler_costs(args.repeat), "torch_threads": torch.get_num_threads()}
    if args.step:
        step = step_costs()
        report["embedded_step_ms"] = step
        kernel = report["ms_per_step"]["C kernel"]
        report["sampling_share_of_step"] = {
            f"{name} x{rows}": f"{(kernel[f'{name} x{rows}'] - kernel[f'greedy x{rows}']) / step[rows]:.1%}"
            for name in SETTINGS if name != "greedy" for rows in ROWS}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
