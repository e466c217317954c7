"""Speculative decoding at one client: rill's modes (off, n-gram, a draft model) and llama-server's
(off, its n-gram lookup, a draft model) side by side, one request at a time, in one run.

    python -m bench.speculative [--model M] [--draft-model D] [--modes off,ngram,draft]
                                [--peers llama-server,llama-server-ngram,llama-server-draft]
                                [--max-tokens 256] [--text-tokens 500] [--rounds 1] [--tasks ...]

The embedded model (SmolLM2-135M GGUF) by default; the draft model by default is the model itself
(every guess right but as dear as the target: the upper bound of acceptance, not of speed).
Input-grounded prompts (repeat, edit, summarize a part of bench/data/apache-2.0.txt; comment the
functions of bench/data/inventory.py) and an open-ended chat prompt, greedy. rill runs on the
engine alone (one core, its speculator swapped per mode, the order alternating per round); each
llama-server variant is a server of its own (the model's GGUF, `-np 1`, built by
`python -m bench.peers setup llama-server`), asked over `/completion` with the same token ids. Prints per prompt and server: decode tok/s (rill: tokens
after the first over the time from the first to the last; llama-server: its own
`predicted_per_second`), the speed-up over the same server without speculation, drafted and
accepted tokens, and whether the tokens are those of the same server without speculation (they
must be); then rill's n-gram mode over llama-server's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from pathlib import Path

from engine import EngineConfig, SamplingParams
from engine.chat_template import encode_chat
from engine.core import EngineCore
from engine.model.loading import load_model
from engine.speculative import Speculator, make_speculator

TEXT = Path(__file__).parent / "data" / "apache-2.0.txt"
CODE = Path(__file__).parent / "data" / "inventory.py"  # a small program of ours, about 450 tokens
TASKS = {
    "repeat": "Repeat the following text exactly, word for word:\n\n{text}",
    "edit": "Rewrite the following text with every occurrence of \"License\" replaced by \"Agreement\". "
            "Change nothing else:\n\n{text}",
    "summarize": "Summarize the following text, quoting its key sentences:\n\n{text}",
    "code": "Add a one-line comment above each function in this Python code and return the whole code:\n\n"
            "```python\n{code}```",
    "chat": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}
MODES = ("off", "ngram", "draft")
# llama-server's variants (this build's flags: `llama-server --help`, "speculative params"):
# ngram-simple is its prompt lookup (the last occurrence of the current n-gram, the tokens after it)
PEERS = {
    "llama-server": [],
    "llama-server-ngram": ["--spec-type", "ngram-simple"],
    "llama-server-draft": ["--spec-type", "draft-simple", "--spec-draft-model", "{draft}",
                           "--spec-draft-n-max", "{k}"],
}


def excerpt(tokenizer, num_tokens: int) -> str:
    """The license's text from its definitions on, cut at a line end near `num_tokens` tokens."""
    text = TEXT.read_text()
    text = text[text.find("1. Definitions"):] if "1. Definitions" in text else text
    ids = tokenizer.encode(text, add_special_tokens=False)[:num_tokens]
    cut = tokenizer.decode(ids)
    return cut[:cut.rfind("\n")] if "\n" in cut else cut


@dataclasses.dataclass
class Result:
    """One server's runs of one prompt."""

    speeds: list[float] = dataclasses.field(default_factory=list)  # decode tok/s per round
    tokens: list[int] = dataclasses.field(default_factory=list)  # the last round's output
    drafted: int = 0  # over every round
    accepted: int = 0

    @property
    def speed(self) -> float:
        return statistics.median(self.speeds) if self.speeds else float("nan")


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


def measure_rill(args, loaded, prompts: dict[str, list[int]]) -> dict[str, dict[str, Result]]:
    """task -> mode -> Result, on one core whose speculator is swapped per mode."""
    k = args.num_speculative_tokens
    core = EngineCore(loaded.model, loaded.tokenizer, EngineConfig(num_speculative_tokens=k), loaded.context_length)
    speculators: dict[str, Speculator | None] = {"off": None, "ngram": Speculator(k, core.config.speculative_max_seqs)}
    if "draft" in args.modes:
        if args.draft_model:
            from engine.draft import load_draft

            draft = load_draft(args.draft_model, loaded)
        else:
            draft = loaded  # the model drafting for itself
        config = dataclasses.replace(core.config, speculative="draft", draft_model=args.draft_model or "itself")
        speculators["draft"] = make_speculator(config, draft, core.max_model_len, core.vocab_size)
    results = {}
    for name, prompt in prompts.items():
        results[name] = by_mode = {mode: Result() for mode in args.modes}
        for r in range(args.rounds):
            for mode in (args.modes if r % 2 == 0 else args.modes[::-1]):
                core.speculator = speculators[mode]
                tokens, seconds, drafted, accepted = run_one(core, prompt, args.max_tokens)
                result = by_mode[mode]
                result.speeds.append((len(tokens) - 1) / seconds if seconds > 0 else float("nan"))
                result.tokens, result.drafted, result.accepted = tokens, result.drafted + drafted, result.accepted + accepted
    return results


def measure_llama_server(variant: str, args, gguf: Path, draft_gguf: Path, prompts: dict[str, list[int]]
                         ) -> dict[str, Result] | str:
    """prompt -> Result of one llama-server variant, or why it did not run."""
    import httpx

    from bench.peers import RESULTS, LlamaServer
    from bench.servers import Server, ServerProcess, free_port

    peer = LlamaServer()
    if not peer.state().ready:
        return f"not ready: {peer.state().detail}"
    port = free_port()
    extra = [part.format(draft=draft_gguf, k=args.num_speculative_tokens) for part in PEERS[variant]]
    command = [str(peer.binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "-t", str(threads()), "-np", "1", "-c", "8192", *extra]
    proc = ServerProcess(Server(variant, command, "/health", env=peer._env()), gguf.parent,
                         RESULTS / "logs" / f"speculative-{variant}.log", port=port)
    results: dict[str, Result] = {}
    try:
        proc.wait_ready(120)
        print(f"== {variant}: {' '.join(command[1:])}", flush=True)
        for name, prompt in prompts.items():
            results[name] = result = Result()
            for _ in range(args.rounds):
                body = httpx.post(f"{proc.url}/completion", timeout=600, json={
                    "prompt": prompt, "n_predict": args.max_tokens, "temperature": 0, "return_tokens": True,
                    "cache_prompt": False}).json()
                timings = body.get("timings", {})
                result.speeds.append(float(timings.get("predicted_per_second", float("nan"))))
                result.tokens = body.get("tokens") or []
                result.drafted += int(timings.get("draft_n", 0))
                result.accepted += int(timings.get("draft_n_accepted", 0))
    except (RuntimeError, httpx.HTTPError) as error:
        return f"failed: {error}"
    finally:
        proc.stop()
    return results


def threads() -> int:
    """llama-server's threads: as many as rill's (OMP_NUM_THREADS when set, else every core)."""
    return int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.speculative", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    parser.add_argument("--draft-model", default=None,
                        help="rill's draft model (default: the model itself, the upper bound of acceptance)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"rill's, comma-separated: {', '.join(MODES)}")
    parser.add_argument("--peers", default="", help=f"comma-separated: {', '.join(PEERS)} (default none); "
                        "their draft is --draft-model when it is a .gguf, else the model's GGUF")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--text-tokens", type=int, default=500, help="tokens of the license text in the grounded prompts")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--tasks", default=",".join(TASKS))
    args = parser.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    peers = [p for p in args.peers.split(",") if p]
    for mode in args.modes:
        if mode not in MODES:
            parser.error(f"--modes: {mode!r} is not one of {', '.join(MODES)}")
    for peer in peers:
        if peer not in PEERS:
            parser.error(f"--peers: {peer!r} is not one of {', '.join(PEERS)}")
    if "off" not in args.modes:
        args.modes.insert(0, "off")
    loaded = load_model(args.model)
    tok = loaded.tokenizer
    text = excerpt(tok, args.text_tokens)
    code = CODE.read_text()
    prompts = {name: encode_chat(tok, [{"role": "user", "content": TASKS[name].format(text=text, code=code)}])
               for name in args.tasks.split(",")}
    print(f"model {args.model or 'embedded SmolLM2-135M'}, draft {args.draft_model or 'the model itself'}, "
          f"max_tokens {args.max_tokens}, k {args.num_speculative_tokens}, {args.rounds} round(s), greedy, "
          f"one request at a time; rill on the engine alone", flush=True)
    table: dict[str, dict[str, Result | str]] = {name: {} for name in prompts}
    for name, by_mode in measure_rill(args, loaded, prompts).items():
        table[name].update({f"rill {mode}": result for mode, result in by_mode.items()})
    if peers:
        gguf = Path(loaded.source)
        if gguf.suffix != ".gguf":
            print(f"llama-server needs a GGUF: {loaded.source} is not one; peers skipped")
            peers = []
        draft_gguf = Path(args.draft_model) if args.draft_model and args.draft_model.endswith(".gguf") else gguf
        if "llama-server" not in peers and peers:
            peers.insert(0, "llama-server")  # each variant's speed-up is over it
    for variant in peers:
        outcome = measure_llama_server(variant, args, gguf, draft_gguf, prompts)
        for name in prompts:
            table[name][variant] = outcome if isinstance(outcome, str) else outcome[name]
    print_table(table, prompts)
    return 0


def print_table(table: dict[str, dict[str, Result | str]], prompts: dict[str, list[int]]) -> None:
    print(f"\n{'task':10} {'prompt':>6} {'server':20} {'out':>5} {'tok/s':>7} {'vs off':>7} {'drafted':>7} "
          f"{'accepted':>8} {'rate':>5} same")
    for name, servers in table.items():
        for server, result in servers.items():
            if isinstance(result, str):
                print(f"{name:10} {len(prompts[name]):6d} {server:20} {result}")
                continue
            base = servers.get("rill off" if server.startswith("rill") else "llama-server")
            plain = server in ("rill off", "llama-server")
            speed_up = result.speed / base.speed if isinstance(base, Result) and base.speed > 0 else float("nan")
            same = "-" if plain or not isinstance(base, Result) else ("yes" if result.tokens == base.tokens else "NO")
            rate = f"{result.accepted / result.drafted:5.2f}" if result.drafted else "    -"
            print(f"{name:10} {len(prompts[name]):6d} {server:20} {len(result.tokens):5d} {result.speed:7.1f} "
                  f"{speed_up:6.2f}x {result.drafted:7d} {result.accepted:8d} {rate} {same}")
        for mode, peer in (("ngram", "llama-server-ngram"), ("draft", "llama-server-draft")):
            mine, theirs = servers.get(f"rill {mode}"), servers.get(peer)
            if isinstance(mine, Result) and isinstance(theirs, Result) and theirs.speed > 0:
                print(f"{'':10} rill {mode} / {peer}: {mine.speed / theirs.speed:.2f}x")


if __name__ == "__main__":
    raise SystemExit(main())
