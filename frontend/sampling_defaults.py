"""The one set of sampling defaults: the model's generation config where it has one (as vLLM does
for the fields a request leaves unset), then rill's own (`RILL_SAMPLING`: greedy).

`model_sampling_defaults(engine)` is read once at start-up; frontend/request.py fills every unset
field from it, whichever way the request came in (the page's sliders start at the same values).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields
from pathlib import Path

log = logging.getLogger("rill")

# rill's own, for what the model leaves unset (the embedded GGUF carries no generation config): greedy,
# as Hugging Face's `generate` by default. Sampling (its model card's 0.2 / 0.9 included) made the
# embedded model's first answer wrong about half the time (docs/benchmarks-history.md).
RILL_SAMPLING = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """The model's own sampling defaults; None where it gives none."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None

    def get(self, name: str, fallback):
        """The model's value of `name`, else `fallback`."""
        value = getattr(self, name)
        return fallback if value is None else value


_NAMES = tuple(f.name for f in fields(SamplingDefaults))


def _checked(name: str, value):
    """A generation-config value the engine can use, else None (e.g. a `top_k` of 0 means off)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if name == "top_k":
        return int(value) if value >= 0 and float(value).is_integer() else None
    if name == "top_p":
        return float(value) if 0 < value <= 1 else None
    if name == "min_p":
        return float(value) if 0 <= value <= 1 else None
    if name == "temperature":
        return float(value) if value >= 0 else None
    return float(value) if value > 0 else None


def _usable(read) -> dict:
    """The fields `read(name)` gives that the engine can use."""
    return {name: v for name in _NAMES if (v := _checked(name, read(name))) is not None}


def _from_file(folder: str | None) -> dict:
    """The fields of `generation_config.json` in a local model folder (a remote backend's tokenizer folder)."""
    if not folder:
        return {}
    path = Path(folder) / "generation_config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return _usable(data.get)


def model_sampling_defaults(engine) -> SamplingDefaults:
    """The engine's model's defaults: its loaded generation config (local engines), else the
    `generation_config.json` beside its tokenizer."""
    config = engine.generation_config
    found = _usable(lambda name: getattr(config, name, None)) if config is not None else {}
    if not found:
        found = _from_file(getattr(engine.tokenizer, "name_or_path", None))
    if found:
        log.info("sampling defaults from the model: %s", ", ".join(f"{k}={v}" for k, v in found.items()))
    return SamplingDefaults(**found)
