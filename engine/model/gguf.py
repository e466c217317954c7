"""A GGUF file converted once into `$RILL_CACHE/gguf` as an ordinary safetensors folder.

Transformers de-quantizes a GGUF on every load (tens of seconds), so `engine.model.loading` loads
the converted folder instead; the folder is named by the file's name, size and a digest of its
ends, so a reinstalled copy of the same file finds its conversion.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import torch

from engine.config import rill_cache_dir

logger = logging.getLogger("rill.loading")

CACHE_FORMAT = 1  # bump when the layout of a converted folder changes
GGUF_KEY_BYTES = 16 << 20  # the converted folder is named by a digest of this much of the file's head and tail


def _gguf_cache_key(gguf: Path) -> str:
    """The converted folder's name: the file's name, size and a digest of its first and last 16 MiB
    (its header, metadata and tensors at both ends), not its mtime: a reinstalled copy of the same
    file (a fresh venv, a new clone) finds its conversion instead of adding another."""
    size = gguf.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(gguf, "rb") as f:
        digest.update(f.read(GGUF_KEY_BYTES))
        if size > GGUF_KEY_BYTES:
            f.seek(max(GGUF_KEY_BYTES, size - GGUF_KEY_BYTES))
            digest.update(f.read())
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", gguf.stem)
    return f"{stem}-{size}-{digest.hexdigest()[:16]}-v{CACHE_FORMAT}"


@contextlib.contextmanager
def _parse_gguf_once():
    """Within one conversion, parse the GGUF once and build gguf's tensor-name map once per shape.

    transformers parses the file three times (tokenizer, config, weights) and rebuilds the
    name map for every module of the model: together about two thirds of a conversion. Both are
    pure functions of their arguments; the patch lasts only while converting (at startup).
    """
    try:
        import gguf as gguf_lib
    except ImportError:  # transformers raises its own clear error below
        yield
        return
    original_reader, original_name_map = gguf_lib.GGUFReader, gguf_lib.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def shared_reader(path, mode="r"):
        key = (os.path.realpath(os.fspath(path)), mode)
        if key not in readers:
            readers[key] = original_reader(path, mode)
        return readers[key]

    gguf_lib.GGUFReader = shared_reader
    gguf_lib.get_tensor_name_map = functools.lru_cache(maxsize=None)(original_name_map)
    try:
        yield
    finally:
        gguf_lib.GGUFReader, gguf_lib.get_tensor_name_map = original_reader, original_name_map
        readers.clear()


def _write_converted(gguf: Path, folder: Path, steps) -> None:
    """De-quantize `gguf` and save model + tokenizer into `folder` (3 of the 4 progress steps)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _parse_gguf_once():
        steps.set_postfix_str("reading tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        steps.update()
        steps.set_postfix_str("de-quantizing weights")
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        steps.update()
    # the de-quantized weights are plain tensors: drop the GGUF marker so that they can be saved
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    steps.set_postfix_str("saving")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    steps.update()


def convert_gguf(gguf: Path, target: Path) -> None:
    """De-quantize `gguf` once into `target` (safetensors fp32 + tokenizer), written atomically;
    raises what failed (`load_model` says it as a ModelLoadError)."""
    from tqdm.auto import tqdm

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.{os.getpid()}.", suffix=".tmp", dir=target.parent))
    started = time.monotonic()
    logger.info("converting %s once into %s (later starts load the converted copy)", gguf, target)
    steps = tqdm(total=4, desc=f"rill: converting {gguf.name} (one time)", unit="step")
    try:
        _write_converted(gguf, tmp, steps)
        (tmp / "rill-source.json").write_text(json.dumps({
            "gguf": str(gguf), "size": gguf.stat().st_size, "mtime": gguf.stat().st_mtime,
            "format": CACHE_FORMAT, "seconds": round(time.monotonic() - started, 1)}, indent=1))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent conversion that won: a real error
                raise
            logger.info("another process converted %s first; using its copy", gguf.name)
        steps.update()
    finally:
        steps.close()
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s in %.1f s", gguf.name, time.monotonic() - started)


def converted_gguf_dir(gguf: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache folder a GGUF converts into (keyed by file name, size and a digest of its ends)."""
    gguf = Path(gguf).expanduser().resolve()
    return rill_cache_dir(cache_dir) / "gguf" / _gguf_cache_key(gguf)


STALE_TMP_S = 3600.0  # a temporary folder without a process id (an older rill's) is stale after this long


def remove_stale_conversions(folder: Path) -> None:
    """Remove the temporary folders of conversions that died midway (kill -9, a crash): those whose
    process (the id in the name, `.<key>.<pid>.<random>.tmp`) is gone; one still writing is kept."""
    if not folder.is_dir():
        return
    for tmp in folder.glob(".*.tmp"):
        parts = tmp.name.split(".")  # ["", key parts..., pid, random, "tmp"]
        pid = int(parts[-3]) if len(parts) >= 5 and parts[-3].isdigit() else None
        try:
            if pid is not None:
                try:
                    os.kill(pid, 0)
                    continue  # still running (or another user's process: not ours to judge)
                except ProcessLookupError:
                    pass
                except PermissionError:
                    continue
            elif time.time() - tmp.stat().st_mtime < STALE_TMP_S:
                continue
        except OSError:
            continue
        logger.info("removing %s, left by a conversion that did not finish", tmp)
        shutil.rmtree(tmp, ignore_errors=True)
