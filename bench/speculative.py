"""Speculative decoding with n-gram drafts against none, one request at a time, on the engine alone.

    python -m bench.speculative [--model M] [--max-tokens 256] [--text-tokens 500] [--rounds 1]

The embedded model (SmolLM2-135M GGUF) by default. Input-grounded prompts (repeat, edit,
summarize a part of bench/data/apache-2.0.txt) and an open-ended chat prompt, greedy, each run
with `speculative="off"` and `"ngram"` in turn (the order alternating per round). Prints per
prompt: decode tok/s (tokens after the first over the time from the first to the last),
speed-up, drafted and accepted tokens, and whether both gave the same tokens (they must).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from engine import EngineConfig, SamplingParams
from engine.chat_template import encode_chat
from engine.core import EngineCore
from engine.model.loading import load_model

TEXT = Path(__file__).parent / "data" / "apache-2.0.txt"
TASKS = {
    "repeat": "Repeat the following text exactly, word for word:\n\n{text}",
    "edit": "Rewrite the following text with every occurrence of \"License\" replaced by \"Agreement\". "
            "Change nothing else:\n\n{text}",
    "summarize": "Summarize the following text, quoting its key sentences:\n\n{text}",
    "chat": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def excerpt(tokenizer, num_tokens: int) -> str:
    """The license's text from its definitions on, cut at a line end near `num_tokens` tokens."""
    text = TEXT.read_text()
    text = text[text.find("1. Definitions"):] if "1. Definitions" in text else text
    ids = tokenizer.encode(text, add_special_tokens=False)[:num_tokens]
    cut = tokenizer.decode(ids)
    return cut[:cut.rfind("\n")] if "\n" in cut else cut


def run_one(core: EngineCore, prompt: list[int], max_tokens: int) -> tuple[list[int], float, int, int]:
    """(tokens, decode seconds after the first token, drafted, accepted) of one request alone."""
    before = core.stats()
    core.add_request(f"bench-{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    tokens, first = [], None
    while core.has_work():
        for out in core.step():
            tokens += out.token_ids
            if first is None and tokens:
                first = time.perf_counter()
    end = time.perf_counter()
    after = core.stats()
    return (tokens, end - first, after.spec_draft_tokens - before.spec_draft_tokens,
            after.spec_accepted_tokens - before.spec_accepted_tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.speculative", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--text-tokens", type=int, default=500, help="tokens of the license text in the grounded prompts")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--tasks", default=",".join(TASKS))
    args = parser.parse_args(argv)
    loaded = load_model(args.model)
    tok = loaded.tokenizer
    text = excerpt(tok, args.text_tokens)
    prompts = {name: encode_chat(tok, [{"role": "user", "content": TASKS[name].format(text=text)}])
               for name in args.tasks.split(",")}
    # one core (its model's linears are packed once); "off" runs without its speculator
    core = EngineCore(loaded.model, tok, EngineConfig(speculative="ngram", num_speculative_tokens=args.num_speculative_tokens),
                      loaded.context_length)
    speculator = core.speculator
    print(f"model {args.model or 'embedded SmolLM2-135M'}, max_tokens {args.max_tokens}, "
          f"k {args.num_speculative_tokens}, {args.rounds} round(s), engine alone, one request at a time")
    print(f"{'task':10} {'prompt':>6} {'out':>5} {'off tok/s':>9} {'ngram tok/s':>11} {'speed-up':>8} "
          f"{'drafted':>7} {'accepted':>8} {'rate':>5} same")
    for name, prompt in prompts.items():
        speeds: dict[str, list[float]] = {"off": [], "ngram": []}
        outputs, drafted, accepted = {}, 0, 0
        for r in range(args.rounds):
            for mode in (("off", "ngram") if r % 2 == 0 else ("ngram", "off")):
                core.speculator = speculator if mode == "ngram" else None
                tokens, seconds, d, a = run_one(core, prompt, args.max_tokens)
                speeds[mode].append((len(tokens) - 1) / seconds if seconds > 0 else float("nan"))
                outputs[mode] = tokens
                drafted, accepted = drafted + d, accepted + a
        off, ngram = statistics.median(speeds["off"]), statistics.median(speeds["ngram"])
        print(f"{name:10} {len(prompt):6d} {len(outputs['off']):5d} {off:9.1f} {ngram:11.1f} {ngram / off:7.2f}x "
              f"{drafted:7d} {accepted:8d} {accepted / max(drafted, 1):5.2f} "
              f"{'yes' if outputs['off'] == outputs['ngram'] else 'NO'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
