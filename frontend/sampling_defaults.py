"""Each route's default sampling, from the model: its generation config where it has one (as vLLM
does for the fields a request leaves unset), and the settings its model card recommends for the
embedded SmolLM2-135M-Instruct (whose GGUF carries no generation config).

`model_sampling_defaults(engine)` is read once at start-up; the page's sliders, its `/chat` API,
`POST /chat` and the OpenAI routes all fill unset fields from it, then from their own fallbacks.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields, replace
from pathlib import Path

log = logging.getLogger("rill")

# What a model card recommends, for models whose files say nothing (matched by the model's name).
# SmolLM2's card: "temperature=0.2, top_p=0.9" (huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct).
MODEL_CARD_DEFAULTS = {"SmolLM2-135M-Instruct": {"temperature": 0.2, "top_p": 0.9}}


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """The model's own sampling defaults; None where it gives none."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None

    def get(self, name: str, fallback):
        """The model's value of `name`, else `fallback`."""
        value = getattr(self, name)
        return fallback if value is None else value

    def filled(self, fallbacks: dict, **given) -> dict:
        """A request's sampling fields (`given`): each one it left unset (None) takes the model's
        value, else the route's own fallback."""
        return {name: self.get(name, fallbacks[name]) if value is None else value for name, value in given.items()}


_NAMES = tuple(f.name for f in fields(SamplingDefaults))


def _checked(name: str, value):
    """A generation-config value the engine can use, else None (e.g. a `top_k` of 0 means off)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if name == "top_k":
        return int(value) if value >= 0 and float(value).is_integer() else None
    if name == "top_p":
        return float(value) if 0 < value <= 1 else None
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
    """The engine's model's defaults: its loaded generation config (local engines) or the
    `generation_config.json` beside its tokenizer, then the model card's table for what is still unset."""
    config = engine.generation_config
    found = _usable(lambda name: getattr(config, name, None)) if config is not None else {}
    if not found:
        found = _from_file(getattr(engine.tokenizer, "name_or_path", None))
    card = MODEL_CARD_DEFAULTS.get(engine.model_name or "", {})
    values = {**card, **found}
    defaults = SamplingDefaults(**values)
    if values:
        log.info("sampling defaults from the model: %s", ", ".join(f"{k}={v}" for k, v in values.items()))
    return defaults


def with_model_defaults(settings, defaults: SamplingDefaults):
    """A `ChatSettings` (or any dataclass with these fields) with the model's values over its own."""
    return replace(settings, **{name: getattr(defaults, name) for name in _NAMES
                                if getattr(defaults, name) is not None and hasattr(settings, name)})
