"""How far the lossy weight paths are from float32: `python -m bench.divergence`.

The embedded SmolLM2 reads one fixed text (bench/data/apache-2.0.txt, the Apache License 2.0,
about 2,400 tokens) with teacher forcing, once per path, and each path's next-token distributions
are compared with the float32 model's (the GGUF de-quantized, `--quantize none`) at every
position: top-1 agreement and mean KL(float32 || path), in nats. Paths: the GGUF's blocks with
float32 activations (exact up to the order of additions: the check that the comparison works),
the same blocks with int8 activations (`--activations int8`), and the float32 weights quantized at
load to q8_0 and to q4_0 (`--quantize q8_0|q4_0` on the de-quantized model). `--model M`: a
checkpoint's own paths (its 16-bit weights kept, each `--quantize`) against it upcast to float32.

`--kv-cache`: the KV cache's dtypes instead (`--kv-cache-dtype`), on the float32 model (or `--model` in
float32): the text
read through the engine's paged attention in prompt chunks of 256 tokens, every key and value
stored in the cache and read back from it, float32 against bfloat16 and float16.
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
# `--model`: a checkpoint's own paths against it upcast to float32 (`--dtype float32`)
CHECKPOINT_PATHS = (("its 16-bit weights kept (--dtype auto)", dict()),
                    *((f"quantized at load to {kind}", dict(quantize=kind)) for kind in ("q8_0", "q6_k", "q4_k", "q4_0")))


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


@torch.inference_mode()
def paged_log_probs(model, ids: torch.Tensor, kv_dtype: torch.dtype, chunk: int = 256) -> torch.Tensor:
    """ids [1, T] -> float64 log-probabilities [T - 1, vocab], read in chunks through the paged cache."""
    from engine.attention import ATTN_NAME, PagedKVCache, PrefillChunk, StepMetadata
    from engine.runner.paged import kv_geometry

    model.set_attn_implementation(ATTN_NAME)
    total = ids.shape[1]
    num_layers, num_kv_heads, head_dim = kv_geometry(model.config)
    cache = PagedKVCache(num_layers, 1 + -(-total // 16), 16, num_kv_heads, head_dim, kv_dtype, model.device)
    slots = torch.arange(16, 16 + total)  # blocks 1.. in order (block 0 stays the padding block)
    rows = []
    for start in range(0, total, chunk):
        n = min(chunk, total - start)
        step = StepMetadata(cache=cache, slot_mapping=slots[start:start + n], decode_token_index=None,
                            decode_slots=None, decode_context_lens=None,
                            prefills=[PrefillChunk(0, n, start, slots[:start + n])])
        out = model(input_ids=ids[:, start:start + n], position_ids=torch.arange(start, start + n)[None],
                    use_cache=False, logits_to_keep=0, rill_step=step)
        rows.append(out.logits[0])
    return torch.log_softmax(torch.cat(rows)[:-1].double(), dim=-1)


def compare(label: str, weights: str, ref: torch.Tensor, test: torch.Tensor) -> None:
    kl = (ref.exp() * (ref - test)).sum(dim=-1)  # [T - 1]
    agree = (ref.argmax(dim=-1) == test.argmax(dim=-1)).double().mean().item()
    print(f"| {label} | {weights} | {agree:.2%} | {kl.mean().item():.2e} | {kl.max().item():.2e} |", flush=True)


def kv_cache_main(model: str | None, tokens: int) -> None:
    """float32 against 16-bit KV caches on the float32 model (see the module docstring)."""
    from engine.model.loading import load_model

    loaded = load_model(model, dtype="float32", quantize="none")
    ids = loaded.tokenizer(TEXT.read_text(), return_tensors="pt").input_ids
    ids = ids[:, :tokens] if tokens else ids
    ref = paged_log_probs(loaded.model, ids, torch.float32)
    print(f"{loaded.name}, {ids.shape[1]} tokens of {TEXT.name}, on {cpu_name()} ({torch.get_num_threads()} threads)")
    print("| KV cache | weights | top-1 agreement | mean KL (nats) | max KL |")
    print("|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        test = ref if dtype == torch.float32 else paged_log_probs(loaded.model, ids, dtype)
        compare(str(dtype).removeprefix("torch."), loaded.weights, ref, test)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=0, help="read only this many tokens of the text (0: all)")
    parser.add_argument("--kv-cache", action="store_true", help="compare the KV cache's dtypes instead")
    parser.add_argument("--model", help="a checkpoint (folder or hub id): its lean paths against it in float32 "
                                        "(default: the embedded GGUF's paths against its float32 model)")
    args = parser.parse_args(argv)
    from engine.model.loading import load_model

    if args.kv_cache:
        return kv_cache_main(args.model, args.tokens)

    model = args.model or None
    paths = CHECKPOINT_PATHS if model else PATHS
    reference = load_model(model, dtype="float32", quantize="none")
    ids = reference.tokenizer(TEXT.read_text(), return_tensors="pt").input_ids
    if args.tokens:
        ids = ids[:, :args.tokens]
    ref = log_probs(reference, ids)
    print(f"{reference.name}, {ids.shape[1]} tokens of {TEXT.name}, on {cpu_name()} ({torch.get_num_threads()} threads)")
    print("| path | weights | top-1 agreement | mean KL (nats) | max KL |")
    print("|---|---|---|---|---|")
    del reference
    for label, kwargs in paths:
        loaded = load_model(model, **kwargs)
        compare(label, loaded.weights, ref, log_probs(loaded, ids))
        del loaded


if __name__ == "__main__":
    main()
