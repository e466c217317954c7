"""Closed-loop streaming load client for rill and its baselines.

    python -m bench --url http://127.0.0.1:7860 --api chat --concurrency 1,8,32,64 \
        --prompt-tokens 20 --max-tokens 64 --tokenizer MODEL_DIR --out results.json

At each concurrency level C, C clients each send a request, read its stream to the end and
send the next, until the level's requests are done ("closed loop"). Every received text is
re-tokenized with the model's tokenizer, so every server is counted the same way whatever
its chunking. Per level: output tokens/s, requests/s, time to first token (TTFT), inter-token
latency (ITL: per request, time from the first to the last piece divided by the tokens after
the first), end-to-end latency, each at p50/p90/p99, and errors.

APIs: `chat` (rill's and the seed's `/chat` SSE), `openai` (`/v1/completions`, or
`/v1/chat/completions` with `--openai-endpoint chat`), `gradio` (`gradio_client`,
`api_name="/chat"`, each update the text so far).

The client is one process: asyncio with bench/lean_http.py for the HTTP APIs, gradio_client's
worker threads for Gradio. On a 2-core machine it shares the CPU with the server: each level
reports the client's own CPU seconds per output token (`client_cpu_ms_per_token`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# ---------------------------------------------------------------------------------------------
# Workloads: what to send
# ---------------------------------------------------------------------------------------------

_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no will "
    "time river city music light garden history water paper story market window morning letter "
    "mountain question answer engine server stream token model number table simple small large "
    "quick slow bright dark early late open close write read build measure travel remember explain "
    "compare describe summer winter village station library kitchen teacher student doctor friend"
).split()

WORKLOADS = {
    # name: (prompt tokens, max tokens, shared prefix tokens)
    "short": (20, 64, 0),
    "long-prompt": (1000, 32, 0),
    "long-output": (16, 512, 0),
    "shared-prefix": (20, 64, 500),
}


def _text_of_tokens(tokenizer, rng: random.Random, num_tokens: int) -> str:
    """Text of about `num_tokens` tokens: random common words, cut at the token count."""
    words = [rng.choice(_WORDS) for _ in range(num_tokens * 2 + 8)]
    ids = tokenizer.encode(" ".join(words), add_special_tokens=False)[:num_tokens]
    return tokenizer.decode(ids).strip()


def make_prompts(tokenizer, count: int, prompt_tokens: int, shared_prefix_tokens: int = 0, seed: int = 0) -> list[str]:
    """`count` different prompts; with a shared prefix, all start with the same system text."""
    rng = random.Random(seed)
    prefix = ""
    if shared_prefix_tokens:
        prefix = "System: " + _text_of_tokens(tokenizer, random.Random(seed + 10_000), shared_prefix_tokens) + "\n\nQuestion: "
    return [prefix + _text_of_tokens(tokenizer, rng, prompt_tokens) for _ in range(count)]


def load_dataset(path: str) -> list[dict]:
    """JSONL: one object per line with `prompt` (required) and optionally `max_tokens`."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise SystemExit(f"{path}:{line_no}: each line must be a JSON object with a string `prompt`; got {line[:80]!r}")
            rows.append(row)
    if not rows:
        raise SystemExit(f"{path}: no prompts")
    return rows


# ---------------------------------------------------------------------------------------------
# One request's record
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class RequestRecord:
    """What one request saw: when it was sent, when each text piece arrived, the text."""

    start: float  # time.perf_counter() when sent
    piece_times: list[float] = field(default_factory=list)  # arrival of each non-empty piece
    text: str = ""
    end: float = 0.0
    error: str | None = None
    output_tokens: int = 0  # filled after the level, by re-tokenizing `text`


# ---------------------------------------------------------------------------------------------
# Streaming clients
# ---------------------------------------------------------------------------------------------


async def _sse_events(response):
    """Yield (event, data) from an SSE response; multi-line data joined with newlines."""
    event, data = "message", []
    async for line in response.aiter_lines():
        if line == "":
            if data:
                yield event, "\n".join(data)
            event, data = "message", []
            continue
        if line.startswith(":"):
            continue  # comment / keep-alive
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "event":
            event = value
        elif name == "data":
            data.append(value)
    if data:
        yield event, "\n".join(data)


class ChatApi:
    """rill's and the seed's `/chat`: `data:` text pieces, then `event: end`."""

    name = "chat"

    def __init__(self, url: str, max_tokens: int, ignore_eos: bool):
        self.url = url.rstrip("/") + "/chat"
        self.max_tokens = max_tokens
        self.ignore_eos = ignore_eos

    async def run(self, client, prompt: str, max_tokens: int, record: RequestRecord) -> None:
        body = {"prompt": prompt, "stream": True, "max_new_tokens": max_tokens, "temperature": 0, "raw": True}
        if self.ignore_eos:
            body["ignore_eos"] = True
        parts = []
        async with client.stream("POST", self.url, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
            async for event, data in _sse_events(response):
                if event == "message":
                    if data:
                        record.piece_times.append(time.perf_counter())
                        parts.append(data)
                elif event == "error":
                    raise RuntimeError(f"error event: {data[:200]}")
                elif event == "end":
                    break
        record.text = "".join(parts)


class OpenAIApi:
    """`/v1/completions` (raw prompt) or `/v1/chat/completions` (one user message), streaming."""

    name = "openai"

    def __init__(self, url: str, max_tokens: int, ignore_eos: bool, endpoint: str = "completions", model: str | None = None,
                 temperature: float = 0.0):
        base = url.rstrip("/")
        if not base.endswith("/v1"):
            base += "/v1"
        self.endpoint = endpoint
        self.url = base + ("/completions" if endpoint == "completions" else "/chat/completions")
        self.ignore_eos = ignore_eos
        self.model = model
        self.temperature = temperature

    async def run(self, client, prompt: str, max_tokens: int, record: RequestRecord) -> None:
        body: dict = {"stream": True, "max_tokens": max_tokens, "temperature": self.temperature}
        if self.model:
            body["model"] = self.model
        if self.endpoint == "completions":
            body["prompt"] = prompt
        else:
            body["messages"] = [{"role": "user", "content": prompt}]
        if self.ignore_eos:
            body["ignore_eos"] = True
        parts = []
        async with client.stream("POST", self.url, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
            async for event, data in _sse_events(response):
                if data.strip() == "[DONE]":
                    break
                if event == "error":
                    raise RuntimeError(f"error event: {data[:200]}")
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"error chunk: {str(chunk['error'])[:200]}")
                for choice in chunk.get("choices") or ():
                    piece = choice.get("text") if self.endpoint == "completions" else (choice.get("delta") or {}).get("content")
                    if piece:
                        record.piece_times.append(time.perf_counter())
                        parts.append(piece)
        record.text = "".join(parts)


class GradioApi:
    """`gradio_client` on `api_name="/chat"`: each update is the answer so far."""

    name = "gradio"

    def __init__(self, url: str, max_tokens: int, ignore_eos: bool, api_name: str = "/chat"):
        self.url = url
        self.api_name = api_name
        self.client = None
        self.param_names: list[str] = []

    def open(self, concurrency: int) -> None:
        from gradio_client import Client

        self.client = Client(self.url, max_workers=max(concurrency, 4), verbose=False)
        info = self.client.view_api(return_format="dict", print_info=False)
        endpoint = (info.get("named_endpoints") or {}).get(self.api_name)
        if endpoint is None:
            raise SystemExit(f"{self.url} has no Gradio endpoint {self.api_name}; it has {sorted(info.get('named_endpoints') or {})}")
        self.param_names = [p.get("parameter_name") for p in endpoint.get("parameters", [])]

    def _kwargs(self, prompt: str, max_tokens: int) -> dict:
        kwargs = {}
        names = self.param_names
        for key in ("message", "prompt", "text", "query"):
            if key in names:
                kwargs[key] = prompt
                break
        else:
            kwargs[names[0]] = prompt
        for key in ("max_new_tokens", "max_tokens"):
            if key in names:
                kwargs[key] = max_tokens
        if "temperature" in names:
            kwargs["temperature"] = 0
        return kwargs

    async def run(self, client, prompt: str, max_tokens: int, record: RequestRecord) -> None:
        job = self.client.submit(api_name=self.api_name, **self._kwargs(prompt, max_tokens))
        helper = job.communicator
        times: list[float] = []

        class _TimedList(list):
            def append(self, item):
                times.append(time.perf_counter())
                super().append(item)

        with helper.lock:  # gradio_client appends each update under this lock
            earlier = list(helper.job.outputs)
            times.extend(time.perf_counter() for _ in earlier)
            helper.job.outputs = _TimedList(earlier)
        final = await asyncio.wrap_future(job.future)
        outputs = list(helper.job.outputs)
        last_len = 0
        for when, out in zip(times, outputs):
            text = _gradio_text(out)
            if len(text) > last_len:
                record.piece_times.append(when)
                last_len = len(text)
        record.text = _gradio_text(final) if final is not None else (_gradio_text(outputs[-1]) if outputs else "")
        if not record.piece_times and record.text:
            record.piece_times.append(time.perf_counter())


def _gradio_text(value) -> str:
    """The answer text in a Gradio output: a string, or the last message of a chat history."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        if not value:
            return ""
        if len(value) == 1 or not isinstance(value[0], (dict, list, tuple)):
            return _gradio_text(value[0]) if len(value) == 1 else str(value[-1])
        return _gradio_text(value[-1])
    if isinstance(value, dict):
        content = value.get("content", value.get("value", ""))
        if isinstance(content, list):
            return "".join(c.get("text", "") if isinstance(c, dict) else str(c) for c in content)
        return str(content)
    return str(value)


# ---------------------------------------------------------------------------------------------
# Running a level
# ---------------------------------------------------------------------------------------------


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    ordered = sorted(values)

    def pick(q):
        # linear interpolation between closest ranks
        pos = (len(ordered) - 1) * q
        lo, hi = math.floor(pos), math.ceil(pos)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "mean": sum(ordered) / len(ordered)}


class RssSampler:
    """Peak resident memory of a process and its children, sampled in a thread."""

    def __init__(self, pid: int | None, interval: float = 0.2):
        self.pid = pid
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = None

    def sample(self) -> int:
        if self.pid is None:
            return 0
        try:
            import psutil

            root = psutil.Process(self.pid)
            procs = [root] + root.children(recursive=True)
            total = 0
            for p in procs:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            return total
        except ImportError:
            return _proc_tree_rss(self.pid)
        except Exception:
            return 0

    def _loop(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.sample())
            self._stop.wait(self.interval)

    def __enter__(self):
        if self.pid is not None:
            self.peak = self.sample()
            self._thread = threading.Thread(target=self._loop, daemon=True, name="rss-sampler")
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread:
            self._thread.join()


def _proc_tree_rss(pid: int) -> int:
    """RSS of `pid` and its descendants from /proc (when psutil is missing)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    total, todo, page = 0, [pid], os.sysconf("SC_PAGE_SIZE")
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * page
        except OSError:
            pass
        todo.extend(children.get(p, ()))
    return total


async def run_level(api, prompts: list[str], max_tokens: list[int], concurrency: int, *, timeout: float, progress: bool, label: str) -> tuple[list[RequestRecord], float, float, float]:
    """Send all `prompts` with `concurrency` closed-loop clients; return the records, the start
    and end times, and the client's own CPU seconds meanwhile (every thread of this process)."""
    from bench.lean_http import LeanClient

    records: list[RequestRecord] = []
    next_index = 0
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(prompts), desc=label, unit="req", leave=False, file=sys.stderr, dynamic_ncols=True)
    async with LeanClient(timeout=30.0) as client:

        async def worker():
            nonlocal next_index
            while next_index < len(prompts):
                i = next_index
                next_index += 1
                record = RequestRecord(start=time.perf_counter())
                try:
                    await asyncio.wait_for(api.run(client, prompts[i], max_tokens[i], record), timeout)
                except Exception as exc:  # noqa: BLE001 - every failure is counted as an error
                    record.error = f"{type(exc).__name__}: {exc}"[:300]
                record.end = time.perf_counter()
                records.append(record)
                if bar is not None:
                    bar.update(1)

        t0, cpu0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        t1, cpu1 = time.perf_counter(), time.process_time()
    if bar is not None:
        bar.close()
    return records, t0, t1, cpu1 - cpu0


def summarize(records: list[RequestRecord], t0: float, t1: float, tokenizer, concurrency: int) -> dict:
    ok = [r for r in records if r.error is None]
    for r in ok:
        r.output_tokens = len(tokenizer.encode(r.text, add_special_tokens=False)) if r.text else 0
    wall = t1 - t0
    total_tokens = sum(r.output_tokens for r in ok)
    ttft = [r.piece_times[0] - r.start for r in ok if r.piece_times]
    itl = [(r.piece_times[-1] - r.piece_times[0]) / (r.output_tokens - 1) for r in ok if r.piece_times and r.output_tokens > 1]
    e2e = [r.end - r.start for r in ok]
    errors = [r.error for r in records if r.error]
    return {
        "concurrency": concurrency,
        "requests": len(records),
        "completed": len(ok),
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:3],
        "wall_s": wall,
        "output_tokens": total_tokens,
        "output_tokens_per_request": percentiles([r.output_tokens for r in ok]),
        "output_tokens_per_s": total_tokens / wall if wall > 0 else 0.0,
        "requests_per_s": len(ok) / wall if wall > 0 else 0.0,
        "ttft_s": percentiles(ttft),
        "itl_s": percentiles(itl),
        "e2e_s": percentiles(e2e),
        "pieces_per_request": percentiles([len(r.piece_times) for r in ok]),
    }


async def run_benchmark(args, tokenizer, api, *, label: str = "", log=print) -> dict:
    """Warm up, then run every concurrency level; return the results document."""
    levels = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    prompt_tokens, max_tokens_default, shared = WORKLOADS[args.workload]
    if args.prompt_tokens is not None:
        prompt_tokens = args.prompt_tokens
    if args.max_tokens is not None:
        max_tokens_default = args.max_tokens
    if args.shared_prefix_tokens is not None:
        shared = args.shared_prefix_tokens
    dataset = load_dataset(args.dataset) if args.dataset else None

    warm = make_prompts(tokenizer, args.warmup, prompt_tokens, shared, seed=999)
    if isinstance(api, GradioApi):
        api.open(max(levels))
    warm_records, *_ = await run_level(api, warm, [min(max_tokens_default, 8)] * len(warm), 1, timeout=args.timeout,
                                         progress=False, label="warmup")
    failed = [r.error for r in warm_records if r.error]
    if warm_records and len(failed) == len(warm_records):
        raise RuntimeError(f"{label or api.name}: every warm-up request failed, e.g. {failed[0]}")

    results = []
    with RssSampler(args.server_pid) as rss_run:
        for level_index, concurrency in enumerate(levels):
            count = args.requests if args.requests else max(args.requests_per_client * concurrency, args.min_requests)
            if dataset:
                rows = [dataset[(level_index * 7919 + i) % len(dataset)] for i in range(count)]
                prompts = [r["prompt"] for r in rows]
                maxes = [int(r.get("max_tokens", max_tokens_default)) for r in rows]
            else:
                prompts = make_prompts(tokenizer, count, prompt_tokens, shared, seed=args.seed + 1000 * level_index)
                maxes = [max_tokens_default] * count
            with RssSampler(args.server_pid) as rss_level:
                records, t0, t1, client_cpu_s = await run_level(
                    api, prompts, maxes, concurrency, timeout=args.timeout, progress=not args.no_progress,
                    label=f"{label} c={concurrency}".strip(),
                )
            summary = summarize(records, t0, t1, tokenizer, concurrency)
            tokens = summary["output_tokens"]
            summary["client_cpu_ms_per_token"] = 1000 * client_cpu_s / tokens if tokens else None
            summary["peak_rss_bytes"] = rss_level.peak or None
            results.append(summary)
            log(format_level(label, summary))
    return {
        "label": label,
        "api": api.name,
        "url": args.url,
        "workload": {
            "name": "dataset" if dataset else args.workload,
            "dataset": args.dataset,
            "prompt_tokens": None if dataset else prompt_tokens,
            "shared_prefix_tokens": None if dataset else shared,
            "max_tokens": max_tokens_default,
            "ignore_eos": bool(args.ignore_eos),
            "temperature": args.temperature if api.name == "openai" else 0,
        },
        "peak_rss_bytes": rss_run.peak or None,
        "levels": results,
        "machine": machine_info(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def format_level(label: str, s: dict) -> str:
    def ms(v):
        return "-" if v is None else f"{v * 1000:.0f}"

    rss = f" rss={s['peak_rss_bytes'] / 2**20:.0f}MiB" if s.get("peak_rss_bytes") else ""
    cpu = f" client {s['client_cpu_ms_per_token']:.2f} ms CPU/tok" if s.get("client_cpu_ms_per_token") else ""
    return (
        f"{label:>14} c={s['concurrency']:<3} {s['output_tokens_per_s']:8.1f} tok/s {s['requests_per_s']:6.2f} req/s "
        f"TTFT p50/p99 {ms(s['ttft_s']['p50'])}/{ms(s['ttft_s']['p99'])} ms "
        f"ITL p50 {ms(s['itl_s']['p50'])} ms e2e p50 {ms(s['e2e_s']['p50'])} ms "
        f"err {s['errors']}/{s['requests']}{rss}{cpu}"
    )


def machine_info() -> dict:
    info = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            info["memory_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    try:
        import torch
        import transformers

        info["torch"] = torch.__version__
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def make_api(args):
    if args.api == "chat":
        return ChatApi(args.url, args.max_tokens, args.ignore_eos)
    if args.api == "openai":
        return OpenAIApi(args.url, args.max_tokens, args.ignore_eos, endpoint=args.openai_endpoint, model=args.model_name,
                         temperature=args.temperature)
    if args.api == "gradio":
        return GradioApi(args.url, args.max_tokens, args.ignore_eos, api_name=args.gradio_api_name)
    raise SystemExit(f"--api must be chat, openai or gradio; got {args.api!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="server base URL, e.g. http://127.0.0.1:7860")
    p.add_argument("--api", choices=["chat", "openai", "gradio"], default="chat")
    p.add_argument("--concurrency", default="1,8,32,64", help="comma-separated client counts (default 1,8,32,64)")
    p.add_argument("--requests", type=int, default=None, help="requests per level (default: max(R*concurrency, --min-requests))")
    p.add_argument("--requests-per-client", type=int, default=2, help="R in the default above (default 2)")
    p.add_argument("--min-requests", type=int, default=8, help="at least this many requests per level (default 8)")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="short",
                   help="short: ~20 in/64 out; long-prompt: ~1000 in/32 out; long-output: 16 in/512 out; "
                        "shared-prefix: a shared ~500-token system text + ~20-token questions, 64 out")
    p.add_argument("--prompt-tokens", type=int, default=None, help="prompt length in tokens (overrides the workload)")
    p.add_argument("--shared-prefix-tokens", type=int, default=None, help="shared prefix length (overrides the workload)")
    p.add_argument("--max-tokens", type=int, default=None, help="output tokens per request (overrides the workload)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature on the OpenAI API (default 0: greedy)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests before the levels (default 2)")
    p.add_argument("--ignore-eos", action="store_true", help="ask the server to ignore EOS (sent as ignore_eos; servers without it ignore the field)")
    p.add_argument("--dataset", help="JSONL file, one {\"prompt\": ..., \"max_tokens\"?: ...} per line, used instead of generated prompts")
    p.add_argument("--tokenizer", help="tokenizer (model folder or id) used to build prompts and count output tokens")
    p.add_argument("--openai-endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--model-name", help="`model` field sent on the OpenAI API")
    p.add_argument("--gradio-api-name", default="/chat")
    p.add_argument("--server-pid", type=int, help="sample this process's (and its children's) peak RSS")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request before it counts as an error")
    p.add_argument("--seed", type=int, default=0, help="prompt generator seed")
    p.add_argument("--label", default="", help="name of this run in the results and the plot")
    p.add_argument("--out", help="write the results JSON here")
    p.add_argument("--plot", help="write a PNG of tokens/s and TTFT vs concurrency; with no --url, plot the given result files")
    p.add_argument("results", nargs="*", help="result JSON files to plot (with --plot and no --url)")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.url:
        if args.plot and args.results:
            from bench.plot import plot_files

            plot_files(args.results, args.plot)
            print(f"wrote {args.plot}")
            return 0
        build_parser().error("--url is required (or --plot PNG with result files to plot)")
    if not args.tokenizer:
        build_parser().error("--tokenizer is required: output tokens are counted with the model's tokenizer (a model folder or id)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    api = make_api(args)
    doc = asyncio.run(run_benchmark(args, tokenizer, api, label=args.label or f"{args.api}"))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.out}")
    if args.plot:
        from bench.plot import plot_results

        plot_results([doc], args.plot)
        print(f"wrote {args.plot}")
    return 0 if all(level["completed"] for level in doc["levels"]) else 1
