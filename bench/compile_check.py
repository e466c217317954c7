"""torch.compile (Inductor) against rill's native step on the embedded model, one sequence.

    python -m bench.compile_check [--tokens 48] [--model PATH]

Inductor's best case on this model: transformers' own `generate` with a static KV cache and the
forward compiled (`cpp_wrapper`, `freezing`, fixed shapes, so no paged attention and no batching),
on the float32 weights the GGUF converts to; beside it the same `generate` eager, and rill's
`LLM.generate` (GGUF blocks, one C call per step). Each is timed as (N tokens - 1 token) / (N - 1),
the least of three runs each, so the prompt and the compile are left out (transformers sizes every static cache after the
largest one before it, here the eager runs', so the shapes stay fixed; the graphs Dynamo compiles
while timing are counted: 0 when the numbers are the compiled code's). Prints JSON: ms per token,
the compile's seconds and graphs.
`--model`: a folder or GGUF file instead of the embedded model (rill loads it as it would serve it).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def _per_token(run, tokens: int, rounds: int = 3) -> float:
    """(the least time of `tokens` tokens - the least of 1 token) / (tokens - 1), in ms: the prompt and the
    first step cancel out, and the least of a few runs keeps one slow run from making it negative."""
    def least(n: int) -> float:
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            run(n)
            times.append(time.perf_counter() - start)
        return min(times)

    run(1)
    return (least(tokens) - least(1)) / (tokens - 1) * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--model", type=Path, help="a model folder or GGUF file (default: the embedded GGUF)")
    args = parser.parse_args(argv)
    if args.tokens < 2:
        parser.error(f"--tokens: at least 2 (a step after the first token), given {args.tokens}")
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine import LLM, SamplingParams
    from bench.model import gguf_folder
    from engine.model.loading import embedded_gguf_path

    model_path = args.model or embedded_gguf_path()
    llm = LLM(str(args.model) if args.model else None)
    weights = llm.loaded.weights
    folder = gguf_folder(model_path) if Path(model_path).is_file() else model_path
    prompt = "Tell me a story about a dragon"
    rill = _per_token(lambda n: llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)),
                      args.tokens)
    del llm
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids

    def hf(n: int):
        with torch.inference_mode():
            return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  cache_implementation="static")

    eager = _per_token(hf, args.tokens)
    import torch._inductor.config as inductor

    inductor.cpp_wrapper = True
    inductor.freezing = True
    model.forward = torch.compile(model.forward, fullgraph=False, dynamic=False)
    start = time.perf_counter()
    hf(2)  # compiles the prompt's and the decode's graphs
    compile_s = time.perf_counter() - start
    graphs = counters["stats"]["unique_graphs"]
    compiled = _per_token(hf, args.tokens)
    print(json.dumps({"ms_per_token": {f"rill native step ({weights})": round(rill, 2),
                                       "transformers generate, static cache, eager (float32)": round(eager, 2),
                                       "transformers generate, static cache, torch.compile (float32)": round(compiled, 2)},
                      "compile_s": round(compile_s, 1), "graphs_compiled": graphs,
                      "graphs_compiled_while_timed": counters["stats"]["unique_graphs"] - graphs,
                      "model": str(model_path), "tokens": args.tokens, "torch": torch.__version__,
                      "threads": torch.get_num_threads()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
