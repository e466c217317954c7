"""The GPU figures of `bench/gpu_check.sh` (after its parity tests): bfloat16 agreement with
`generate`, an engine throughput sweep, and the decode attention's memory at long contexts.

- **bfloat16 agreement.** The tiny test models in bfloat16 on the GPU: the engine's greedy tokens
  against `generate`'s, per prompt the share of the 24 tokens before the first difference. Not
  exact by design: the engine batches other rows beside each prompt and its attention sums in
  another order, and a bfloat16 rounding can flip a near-tie.
- **Throughput.** `LLM.generate` alone (no server), a closed batch of N prompts of 20 tokens,
  64 tokens each (`ignore_eos`), bfloat16, random weights in SmolLM2-135M's shape (its own
  tokenizer, `--tokenizer`) and in a 1.2B Llama's shape (Llama-3.2-1B's layers and heads, SmolLM2's
  vocabulary): the Triton decode attention against the torch path, tokens per second.
- **Attention.** The kernel alone on 4,000-position contexts: each (sequence, KV head) in one
  program against its positions split into shares (what a step of few sequences gets).
- **Memory.** Peak CUDA memory above the loaded engine while 32 (64) sequences decode after prompts
  of 4,000 tokens: the torch path gathers every decode's keys and values padded to the longest
  context, per layer; the Triton kernel reads the cache in place.

Usage: python -m bench.gpu_check --tokenizer DIR [--out FILE.json] [--batches 1,8,32,128,256] [--tokens 64]
                                [--sections bf16_agreement,sweep,attention,memory]
       python -m bench.gpu_check --save-tokenizer DIR   (on the CPU machine: the embedded model's tokenizer)
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import tempfile
import time
from pathlib import Path

import torch

DEVICE = "cuda"  # --device cpu runs the same code on the CPU (a dry run of this script, without the memory part)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()

SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, tie_word_embeddings=True),
    "llama-1.2b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
}


def random_model(shape: str, tokenizer_dir: Path, out: Path) -> Path:
    """A random-weight Llama of `shape` with the given tokenizer, saved in bfloat16."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(vocab_size=len(tok), max_position_embeddings=8192, rope_theta=100000.0,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
                         **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(DEVICE):  # initialized where it runs: a 1.2B model's init on the CPU takes a while
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out / shape)
    tok.save_pretrained(out / shape)
    return out / shape


def bf16_agreement(root: Path) -> list[dict]:
    from engine import LLM, EngineConfig, SamplingParams
    from engine.model.loading import load_model
    from tests.test_engine_parity import MAX_TOKENS, make_prompts, reference_outputs
    from tests.tiny_models import build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer()
    rows = []
    for arch in ("llama", "mistral", "qwen2", "gemma2", "gpt2"):
        path = build_tiny_model(arch, root / arch, tokenizer=tokenizer)
        loaded = load_model(str(path), device=DEVICE, dtype="bfloat16")
        prompts = make_prompts(len(loaded.tokenizer))
        llm = LLM(loaded, EngineConfig(max_num_batched_tokens=128))
        got = [r.token_ids for r in llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))]
        shares = []
        for tokens, want in zip(got, reference_outputs(path, prompts, device=DEVICE, dtype=torch.bfloat16)):
            same = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), min(len(tokens), len(want)))
            shares.append(same / MAX_TOKENS)
        rows.append(dict(arch=arch, prompts=len(prompts), identical=sum(s == 1.0 for s in shares),
                         mean_share_before_first_difference=round(sum(shares) / len(shares), 3),
                         kernel_calls=getattr(llm.core.runner.decode_kernel, "calls", None)))
        print(f"bf16 {arch}: {rows[-1]}", flush=True)
        del llm
        empty_cache()
    return rows


def empty_cache() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def sweep(path: Path, batches: list[int], tokens: int, kernel: bool) -> list[dict]:
    from engine import LLM, EngineConfig, SamplingParams
    from engine.model.loading import load_model

    loaded = load_model(str(path), device=DEVICE, dtype="bfloat16")
    vocab = len(loaded.tokenizer)
    llm = LLM(loaded, EngineConfig(max_num_seqs=max(batches), max_num_batched_tokens=max(512, 20 * max(batches)),
                                   max_model_len=4096, decode_kernel=kernel))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate([[rng.randrange(3, vocab) for _ in range(20)] for _ in range(4)], params)  # warm-up, compiles
    rows = []
    for batch in batches:
        prompts = [[rng.randrange(3, vocab) for _ in range(20)] for _ in range(batch)]
        sync()
        start = time.perf_counter()
        results = llm.generate(prompts, params)
        sync()
        seconds = time.perf_counter() - start
        made = sum(len(r.token_ids) for r in results)
        assert made == batch * tokens, (made, batch * tokens)
        rows.append(dict(model=path.name, kernel=getattr(llm.core.runner.decode_kernel, "path", "torch path"), batch=batch,
                         tok_s=round(made / seconds, 1), seconds=round(seconds, 3)))
        print(f"sweep {rows[-1]}", flush=True)
    del llm
    empty_cache()
    return rows


def attention_timing() -> list[dict]:
    """The decode attention alone, one layer's call on contexts of 4,000 positions (bfloat16, blocks
    of 16 scattered over the cache): each (sequence, KV head) whole in one program against its
    positions split into the shares the kernel chooses. Microseconds a call, mean of 50."""
    from engine.kernels.gpu import paged_decode_kernel

    kernel = paged_decode_kernel(torch.device("cuda"))
    rows_out = []
    context, block = 4000, 16
    for name, heads, kv_heads, dim in (("smollm2-135m", 9, 3, 64), ("llama-1.2b", 32, 8, 64)):
        for rows in (1, 4, 32, 128):
            per_row = -(-context // block)
            gen = torch.Generator(device="cuda").manual_seed(rows)
            k_cache = torch.randn(rows * per_row * block, kv_heads, dim, device="cuda", generator=gen).bfloat16()
            v_cache = torch.randn_like(k_cache)
            tables = torch.randperm(rows * per_row, device="cuda", generator=gen).int().view(rows, per_row)
            query = torch.randn(1, heads, rows, dim, device="cuda", generator=gen).bfloat16()
            out = torch.empty(rows, heads, dim, device="cuda", dtype=torch.bfloat16)
            index = torch.arange(rows, device="cuda")
            lens = torch.full((rows,), context, device="cuda")
            row = dict(model=name, sequences=rows, context=context)
            for label, splits in (("whole_us", 1), ("split_us", None)):
                kernel.splits = splits
                call = lambda: kernel(query, out, k_cache, v_cache, index, tables, block, lens, dim ** -0.5, None, None,
                                      context)
                for _ in range(3):
                    call()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(50):
                    call()
                end.record()
                torch.cuda.synchronize()
                row[label] = round(start.elapsed_time(end) * 1000 / 50, 1)
            kernel.splits = None
            row["shares"] = kernel.num_splits(rows * kv_heads, context, None)
            row["whole_over_split"] = round(row["whole_us"] / row["split_us"], 2)
            rows_out.append(row)
            print(f"attention {row}", flush=True)
            del k_cache, v_cache
    return rows_out


def long_context_memory(path: Path, sequences: int, prompt_tokens: int, kernel: bool) -> dict:
    from engine import LLM, EngineConfig, SamplingParams
    from engine.model.loading import load_model

    loaded = load_model(str(path), device="cuda", dtype="bfloat16")
    vocab = len(loaded.tokenizer)
    llm = LLM(loaded, EngineConfig(max_num_seqs=sequences, max_num_batched_tokens=8192, max_model_len=8192,
                                   decode_kernel=kernel))
    rng = random.Random(1)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_tokens)] for _ in range(sequences)]
    # the prompts into the cache first: the run measured below finds their full blocks there (prefix
    # caching), so its peak is that of the decode steps, not of the prompts' long prefill chunks
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    torch.cuda.synchronize()
    row = dict(model=path.name, kernel=getattr(llm.core.runner.decode_kernel, "path", "torch path"), sequences=sequences,
               prompt_tokens=prompt_tokens, decode_steps=32,
               peak_above_engine_mib=round((torch.cuda.max_memory_allocated() - base) / 2**20, 1),
               seconds=round(time.perf_counter() - start, 2))
    print(f"memory {row}", flush=True)
    del llm
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, help="a folder with SmolLM2's tokenizer")
    parser.add_argument("--save-tokenizer", type=Path, help="write the embedded model's tokenizer there, and stop")
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    parser.add_argument("--batches", default="1,8,32,128,256", help="sequences per sweep point")
    parser.add_argument("--tokens", type=int, default=64, help="tokens each sequence generates in the sweep")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="random-weight model shapes of the sweep")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--sections", default="bf16_agreement,sweep,attention,memory", help="which parts to run")
    args = parser.parse_args(argv)
    if args.save_tokenizer:
        from engine.model.loading import load_model

        load_model(None).tokenizer.save_pretrained(args.save_tokenizer)
        print(f"gpu_check: SmolLM2's tokenizer written to {args.save_tokenizer}")
        return 0
    if args.tokenizer is None:
        parser.error("--tokenizer DIR is needed (write one with --save-tokenizer DIR on a machine with the embedded model)")
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("gpu_check: this torch sees no CUDA GPU; nothing to measure")
        return 2
    import transformers

    report = dict(gpu=torch.cuda.get_device_name() if DEVICE == "cuda" else platform.processor(), torch=torch.__version__,
                  transformers=transformers.__version__, python=platform.python_version())
    print(report, flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    tokens = args.tokens
    shapes = args.shapes.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)

        def model(shape: str) -> Path:  # built once, on first use
            return root / shape if (root / shape).exists() else random_model(shape, args.tokenizer, root)

        for section, run in (
            ("bf16_agreement", lambda: bf16_agreement(root)),
            ("sweep", lambda: [row for shape in shapes for kernel in (True, False)
                               for row in sweep(model(shape), batches, tokens, kernel)]),
            ("attention", lambda: attention_timing() if DEVICE == "cuda" else "not on CPU"),
            ("memory", lambda: [long_context_memory(model(shape), n, 4000, kernel)
                                for shape, n in (("smollm2-135m", 32), ("llama-1.2b", 64)) if shape in shapes
                                for kernel in (True, False)] if DEVICE == "cuda" else "not on CPU"),
        ):
            if section not in args.sections.split(","):
                continue
            try:
                report[section] = run()
            except Exception as exc:  # one section's failure still leaves the others' figures
                import traceback

                traceback.print_exc()
                report[section] = f"failed: {type(exc).__name__}: {exc}"
            args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
