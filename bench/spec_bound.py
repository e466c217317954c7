"""How far exact speculation can take one visitor on a model, measured by replay: a greedy answer
does not depend on the guesses (an exact speculator never changes a token), so the answer computed
once without speculation decides every guess a proposer would make and how many the model keeps.

    python -m bench.spec_bound [--model M] [--text-tokens 300,500,1000] [--max-tokens 200]
                               [--tasks repeat,edit,summarize,code,chat] [--layers 6,10,15,20,25]

Prints, per prompt of bench.speculative (its tasks, with --text-tokens of the license text):

- `ngram`: rill's own n-gram speculator (engine/speculative.py, its adaptive draft length and pause)
  replayed over the answer, each step weighed by the measured cost of a step of that many rows
  (timed first with always-right guesses, as bench.verify_cost does): its decode speed-up, which
  bench.speculative measures live within the host's noise;
- `ngram, free checks`: the same guesses with every step costing one plain step: what the proposer
  could reach if checking guesses cost nothing;
- `early exit Ln`: how often the model's own first n layers (then its final norm and head) pick the
  token the whole model picks, over the answer: a draft taken from the model itself, no second
  model, and what it would agree on.

The embedded SmolLM2-135M by default.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.speculative import CODE, TASKS, excerpt, run_one
from bench.verify_cost import timed_steps
from engine import EngineConfig, SamplingParams
from engine.chat_template import encode_chat
from engine.core import EngineCore
from engine.model.loading import load_model
from engine.request import Sequence
from engine.speculative import Speculator


def step_costs(core: EngineCore, prompt: list[int], answer: list[int], k_max: int) -> list[float]:
    """ms of a step of 1..k_max + 1 rows over a plain step's, always-right guesses on `answer`."""
    ms = [min(seconds / max(steps, 1) for seconds, steps in timed_steps(core, prompt, answer, k, 2)[0])
          for k in range(k_max + 1)]
    core.speculator = None
    return [m / ms[0] for m in ms]


def replay(prompt: list[int], answer: list[int], k: int, costs: list[float] | None) -> tuple[float, int, int]:
    """(speed-up, drafted, accepted) of rill's n-gram speculator over `answer`; costs None: free checks."""
    spec = Speculator(k, max_running=1)
    seq = Sequence("replay#0", "replay", 0, prompt + answer[:1], len(prompt),
                   SamplingParams(max_tokens=len(answer), temperature=0))
    seq.num_computed_tokens = len(prompt)  # the prompt's forward made the first token
    spent = 0.0
    while seq.num_output_tokens < len(answer):
        spec.propose([seq], max_model_len=1 << 30)
        draft, done = seq.draft_token_ids, seq.num_output_tokens
        taken = 0
        while taken < len(draft) and draft[taken] == answer[done + taken]:
            taken += 1
        if draft:
            spec._count(seq, len(draft), taken)
        seq.token_ids += answer[done:done + taken + 1]
        seq.num_computed_tokens = len(seq.token_ids) - 1
        spent += 1.0 if costs is None else costs[len(draft)]
    return (len(answer) - 1) / spent, spec.draft_tokens_total, spec.accepted_tokens_total


@torch.inference_mode()
def early_exit_agreement(model, prompt: list[int], answer: list[int], layers: list[int]) -> dict[int, float]:
    """layer n -> the share of the answer's tokens that the first n layers' argmax picks too."""
    ids = torch.tensor([prompt + answer])
    paged = model.config._attn_implementation  # the engine's paged attention needs its step records
    model.config._attn_implementation = "sdpa"
    try:
        hidden = model(ids, output_hidden_states=True).hidden_states  # [embeddings, layer 1, ..., layer N]
    finally:
        model.config._attn_implementation = paged
    rows = slice(len(prompt) - 1, len(prompt) + len(answer) - 1)  # the rows that predict the answer
    full = torch.tensor(answer)  # the whole model's picks (the engine's greedy answer)
    out = {}
    for n in layers:
        picks = model.lm_head(model.model.norm(hidden[n][0, rows])).argmax(-1)
        out[n] = (picks == full).float().mean().item()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.spec_bound", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    parser.add_argument("--text-tokens", default="300,500,1000", help="license-text lengths of the grounded prompts")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--layers", default="6,10,15,20,25", help="early exits to check (0 or empty: none)")
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.text_tokens.split(",") if n]
    layers = [int(n) for n in args.layers.split(",") if n and int(n) > 0]
    tasks = [t for t in args.tasks.split(",") if t]
    for task in tasks:
        if task not in TASKS:
            parser.error(f"--tasks: {task!r} is not one of {', '.join(TASKS)}")
    loaded = load_model(args.model)
    tok, model = loaded.tokenizer, loaded.model
    if layers and max(layers) >= model.config.num_hidden_layers:
        parser.error(f"--layers: each below the model's {model.config.num_hidden_layers} layers, given {args.layers}")
    core = EngineCore(model, tok, EngineConfig(), loaded.context_length)
    prompts = {}
    for n in lengths:
        text = excerpt(tok, n)
        for task in tasks:
            if "{text}" in TASKS[task] or n == lengths[0]:  # code and chat have no license text: once
                label = f"{task} {n}" if "{text}" in TASKS[task] else task
                prompts[label] = encode_chat(tok, [{"role": "user", "content": TASKS[task].format(text=text, code=CODE.read_text())}])
    t0 = time.perf_counter()
    answers = {label: run_one(core, prompt, args.max_tokens)[0] for label, prompt in prompts.items()}
    label = next(iter(prompts))
    costs = step_costs(core, prompts[label], answers[label], args.num_speculative_tokens)
    print(f"model {args.model or 'embedded SmolLM2-135M'}, greedy answers of {args.max_tokens} tokens at most, "
          f"k {args.num_speculative_tokens}; a step of 1..{len(costs)} rows costs "
          + " / ".join(f"{c:.2f}" for c in costs) + f" plain steps (timed on '{label}'); {time.perf_counter() - t0:.0f} s")
    head = f"{'prompt':<15} {'tokens':>6} {'ngram':>7} {'drafted':>8} {'accepted':>8} {'free checks':>11}"
    print(head + "".join(f" {'L' + str(n):>6}" for n in layers))
    for label, prompt in prompts.items():
        answer = answers[label]
        speed, drafted, accepted = replay(prompt, answer, args.num_speculative_tokens, costs)
        free = replay(prompt, answer, args.num_speculative_tokens, None)[0]
        agree = early_exit_agreement(model, prompt, answer, layers) if layers else {}
        print(f"{label:<15} {len(answer):6d} {speed:6.2f}x {drafted:8d} {accepted:8d} {free:10.2f}x"
              + "".join(f" {agree[n]:6.2f}" for n in layers), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
