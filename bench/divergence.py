"""How far the lossy weight paths are from float32: `python -m bench.divergence`.

The embedded SmolLM2 reads one fixed text (bench/data/apache-2.0.txt, the Apache License 2.0,
about 2,400 tokens) with teacher forcing, once per path, and each path's next-token distributions
are compared with the float32 model's (the GGUF de-quantized, `--quantize none`) at every
position: top-1 agreement and mean KL(float32 || path), in nats. Paths: the GGUF's blocks with
float32 activations (exact up to the order of additions: the check that the comparison works),
the same blocks with int8 activations (`--activations int8`), and the float32 weights quantized at
load to q8_0 and to q4_0 (`--quantize q8_0|q4_0` on the de-quantized model).
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

import torch

TEXT = Path(__file__).parent / "data" / "apache-2.0.txt"
PATHS = (("GGUF blocks, float32 activations", dict(quantize="auto")),
         ("GGUF blocks, int8 activations", dict(quantize="auto", activations="int8")),
         ("float32 quantized at load to q8_0, int8 activations", dict(quantize="q8_0", activations="int8")),
         ("float32 quantized at load to q4_0, float32 activations", dict(quantize="q4_0")))


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else ():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


@torch.inference_mode()
def log_probs(loaded, ids: torch.Tensor) -> torch.Tensor:
    """ids [1, T] -> float64 log-probabilities [T - 1, vocab] of each next token."""
    logits = loaded.model(input_ids=ids, use_cache=False).logits[0, :-1]
    return torch.log_softmax(logits.double(), dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=0, help="read only this many tokens of the text (0: all)")
    args = parser.parse_args()
    from engine.model.loading import load_model

    reference = load_model(None, quantize="none")
    ids = reference.tokenizer(TEXT.read_text(), return_tensors="pt").input_ids
    if args.tokens:
        ids = ids[:, :args.tokens]
    ref = log_probs(reference, ids)
    print(f"{reference.name}, {ids.shape[1]} tokens of {TEXT.name}, on {cpu_name()} ({torch.get_num_threads()} threads)")
    print("| path | weights | top-1 agreement | mean KL (nats) | max KL |")
    print("|---|---|---|---|---|")
    del reference
    for label, kwargs in PATHS:
        loaded = load_model(None, **kwargs)
        test = log_probs(loaded, ids)
        kl = (ref.exp() * (ref - test)).sum(dim=-1)  # [T - 1]
        agree = (ref.argmax(dim=-1) == test.argmax(dim=-1)).double().mean().item()
        print(f"| {label} | {loaded.weights} | {agree:.2%} | {kl.mean().item():.2e} | {kl.max().item():.2e} |",
              flush=True)
        del loaded, test


if __name__ == "__main__":
    main()
