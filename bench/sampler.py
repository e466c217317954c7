"""The batched sampler alone: milliseconds per step for greedy and sampled rows at 1, 8 and 32 rows
over the embedded model's vocabulary (49,152), random logits of a chat model's spread.

    python -m bench.sampler [--repeat 50]

Run it in two checkouts to compare two samplers (BENCHMARKS.md has the figures of the commit that
moved the passes to numpy and sampled only the kept candidates, against the one before).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from engine.request import SamplingParams, Sequence
from engine.sampler import Sampler

VOCAB = 49152
SETTINGS = {
    "greedy": dict(temperature=0),
    "temperature 0.7": dict(temperature=0.7),
    "temperature 0.7, top_p 0.9": dict(temperature=0.7, top_p=0.9),
    "temperature 0.7, top_k 50": dict(temperature=0.7, top_k=50),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    sampler = Sampler([0])
    results = {}
    for name, params in SETTINGS.items():
        for rows in (1, 8, 32):
            seqs = [Sequence(f"s{i}", "r", 0, list(range(20)), 10, SamplingParams(max_tokens=64, **params))
                    for i in range(rows)]
            logits = torch.randn(rows, VOCAB, generator=gen) * 3
            for _ in range(3):
                sampler.sample(logits, seqs)
            start = time.perf_counter()
            for _ in range(args.repeat):
                sampler.sample(logits, seqs)
            results[f"{name} x{rows}"] = round((time.perf_counter() - start) / args.repeat * 1000, 3)
    print(json.dumps({"ms_per_step": results, "torch_threads": torch.get_num_threads()}, indent=1))


if __name__ == "__main__":
    main()
