"""What constrained decoding costs: 32 streams in one engine batch, none constrained against half
constrained by a JSON schema, on the embedded SmolLM2-135M (its real 49152-token vocabulary: the
bitmask work per step is what a real model pays).

    python -m bench.structured [--streams 32] [--tokens 128] [--rounds 3] [--model M]

Every stream generates exactly `--tokens` tokens (the unconstrained ones ignore EOS; the schema
asks for more items than fit), so both runs do the same decode work apart from the masks. Runs
alternate (none, half, none, half, ...); the medians are printed with their ratio, and the mask
fill alone (llguidance, per step for 16 rows) is timed apart.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time

from engine import LLM, SamplingParams
from engine.grammar import allowed_tokens
from engine.model.loading import load_model
from engine.request import Constraint

SCHEMA = {"type": "array", "minItems": 200, "items": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]}}, "required": ["name", "age", "role"], "additionalProperties": False}}
PROMPTS = ["List the people in the team as JSON.", "Write a story about a robot.", "Explain paged attention.",
           "Give me a JSON list of users.", "What is the capital of France?", "Describe the sea at night."]


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def run(llm: LLM, streams: int, tokens: int, constrained: int) -> float:
    """Generated tokens per second of one batch of `streams`, the first `constrained` with the schema."""
    constraint = Constraint.json_schema(SCHEMA)
    params = [SamplingParams(max_tokens=tokens, temperature=0.8, seed=i, constraint=constraint) if i < constrained
              else SamplingParams(max_tokens=tokens, temperature=0.8, seed=i, ignore_eos=True)
              for i in range(streams)]
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                                 tokenize=False, add_generation_prompt=True) for i in range(streams)]
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    generated = sum(len(r.token_ids) for r in results)
    short = [len(r.token_ids) for r in results if len(r.token_ids) != tokens]
    if short:
        raise RuntimeError(f"some streams ended early ({short}): the comparison needs equal work")
    return generated / elapsed


def mask_fill_ms(llm: LLM, rows: int, repeats: int = 50) -> float:
    """Median milliseconds to fill and unpack the bitmasks of `rows` constrained sequences."""
    grammars = llm.core.grammars
    constraint = Constraint.json_schema(SCHEMA)
    grammars.compile(constraint)
    matchers = [grammars.matcher(constraint) for _ in range(rows)]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        allowed_tokens(grammars.fill_bitmasks(matchers), llm.core.logits_width)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.structured", description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    args = parser.parse_args(argv)
    llm = LLM(load_model(args.model))
    run(llm, 4, 8, 2)  # warm-up: kernels, llguidance's tokenizer, the schema's compile
    none, half = [], []
    for round_ in range(args.rounds):
        none.append(run(llm, args.streams, args.tokens, 0))
        half.append(run(llm, args.streams, args.tokens, args.streams // 2))
        print(f"round {round_ + 1}: none {none[-1]:.1f} tok/s, half {half[-1]:.1f} tok/s", file=sys.stderr, flush=True)
    fill = mask_fill_ms(llm, args.streams // 2)
    print(json.dumps({"cpu": cpu_name(), "model": llm.loaded.name, "vocab": llm.core.logits_width,
                      "streams": args.streams, "tokens_per_stream": args.tokens, "rounds": args.rounds,
                      "tok_s_none_constrained": [round(x, 1) for x in none],
                      "tok_s_half_constrained": [round(x, 1) for x in half],
                      "median_none": round(statistics.median(none), 1),
                      "median_half": round(statistics.median(half), 1),
                      "ratio_half_over_none": round(statistics.median(half) / statistics.median(none), 3),
                      "mask_fill_ms_16_rows": round(fill, 2)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
