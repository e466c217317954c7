"""One visitor at the memory bound: the bytes a decode step reads, over the bandwidth this host
reads at, against the tokens/s measured, for rill and for llama-server's reading of the same file.

    .venv/bin/python -m bench.memory_bound [GGUF ...] [--tokens 48]

At one sequence a decode step reads every weight once, so tokens/s can be no more than the read
bandwidth over the bytes per step. rill's bytes are what its loaded modules hold for a step (block
panels, float weights, one row of a quantized token table); llama-server's are the file's tensors
(its blocks are read where they lie), the token table counted once, as the tied head's, when there is no
`output.weight`. The bandwidth is the best of a few passes of a 1 GiB float32 sum on the threads
torch uses (rill's own); llama-server's tokens/s come from its `timings` over HTTP, one server at a time.
Without a GGUF argument: the embedded model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import torch
from torch import nn

from bench.run import machine_info
from bench.servers import free_port


def read_bandwidth(gib: float = 1.0, passes: int = 5) -> float:
    """Bytes per second this process reads a `gib`-GiB float32 array at (the best pass)."""
    data = torch.ones(int(gib * (1 << 30)) // 4)
    best = float("inf")
    for _ in range(passes):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.numel() * 4 / best


def step_bytes(model: nn.Module) -> int:
    """Bytes one decode step of one sequence reads from the weights of rill's loaded `model`."""
    from engine.model.gguf import GgufEmbedding

    total = 0
    for module in model.modules():
        if isinstance(module, GgufEmbedding):
            total += module.rows.shape[1]  # one row of the table
        elif isinstance(module, nn.Embedding):
            total += module.embedding_dim * module.weight.element_size()
        else:
            for tensor in list(module._parameters.values()) + list(module._buffers.values()):
                if tensor is not None and tensor.dtype != torch.int64:
                    total += tensor.numel() * tensor.element_size()
            for name in ("panels", "packed"):  # block panels (QuantLinear, FusedProjections), oneDNN's packing
                tensor = module.__dict__.get(name)
                if isinstance(tensor, torch.Tensor):
                    total += tensor.numel() * tensor.element_size()
    return total


def file_step_bytes(gguf: Path) -> int:
    """Bytes llama.cpp reads per step: every tensor of the file once, the token table as one row
    unless it is also the (tied) output head."""
    import numpy as np

    from engine.model.gguf_header import tensor_table

    tensors = tensor_table(np.memmap(gguf, mode="r", dtype=np.uint8))
    tied = all(info.name != "output.weight" for info in tensors)
    total = 0
    for info in tensors:
        if info.name == "token_embd.weight" and not tied:
            total += info.nbytes // info.shape[0]
        else:
            total += info.nbytes
    return total


def rill_tokens_per_second(gguf: Path | None, tokens: int) -> tuple[float, int]:
    from engine import LLM, SamplingParams

    llm = LLM(str(gguf) if gguf else None)
    params = SamplingParams(max_tokens=tokens, temperature=1.0, ignore_eos=True, seed=0)
    llm.generate(["Warm up"], SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True))
    rates = []
    for _ in range(3):
        started = time.perf_counter()
        llm.generate(["Tell me a story about the sea"], params)
        rates.append(tokens / (time.perf_counter() - started))
    return sorted(rates)[1], step_bytes(llm.core.model)


def llama_tokens_per_second(gguf: Path, tokens: int) -> float | None:
    from bench.peers import LlamaServer

    peer = LlamaServer()
    if not peer.state().ready:
        return None
    port = free_port()
    command = [str(peer.binary), "-m", str(gguf), "-t", str(torch.get_num_threads()), "--port", str(port), "-c", "4096"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env=dict(os.environ, **peer._env()))
    try:
        for _ in range(600):
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.2)
        body = json.dumps({"prompt": "Tell me a story about the sea", "max_tokens": tokens, "temperature": 1.0,
                           "ignore_eos": True}).encode()
        rates = []
        for _ in range(4):
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            rates.append(json.load(urllib.request.urlopen(request, timeout=600))["timings"]["predicted_per_second"])
        return sorted(rates[1:])[1]
    finally:
        server.terminate()
        server.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf", nargs="*", type=Path)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--servers", default="rill,llama-server", help="rill, and llama-server where it is built")
    parser.add_argument("--read-gib", type=float, default=1.0, help="GiB of the float32 sum the bandwidth is read on")
    args = parser.parse_args(argv)
    servers = [s for s in args.servers.split(",") if s]
    if not set(servers) <= {"rill", "llama-server"}:
        parser.error(f"--servers: rill and/or llama-server, given {args.servers!r}")
    from engine.model.loading import embedded_gguf_path

    files = args.gguf or [embedded_gguf_path()]
    bandwidth = read_bandwidth(args.read_gib)
    print(f"{machine_info().get('cpu', '?')}, {torch.get_num_threads()} threads: read bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s ({args.read_gib:g} GiB float32 sum, best of 5)\n")
    print("| model | server | bytes / step | bound tok/s | measured tok/s | of the bound |")
    print("|---|---|---|---|---|---|")
    for gguf in files:
        rows = []
        if "rill" in servers:
            rate, nbytes = rill_tokens_per_second(gguf, args.tokens)
            rows.append(("rill", nbytes, rate))
        llama = llama_tokens_per_second(gguf, args.tokens) if "llama-server" in servers else None
        if llama is not None:
            rows.append(("llama-server", file_step_bytes(gguf), llama))
        for server, nbytes, rate in rows:
            bound = bandwidth / nbytes
            print(f"| {gguf.name} | {server} | {nbytes / 1e6:.0f} MB | {bound:.1f} | {rate:.1f} | {rate / bound:.0%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
