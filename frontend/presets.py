"""`--models-preset FILE`: the models one server serves, each with its own settings, in a TOML file
of one table per model (as llama-server's router takes an INI file of sections whose keys are its
command-line options). A table's name is the model's name; `model` says what is loaded (a .gguf
file, a model folder, a Hub id; a relative path from the file's folder), `pin = true` keeps it
loaded, and every other key is a model or engine flag without its `--`, its value typed as TOML
types it (`max-model-len = 8192`, `kv-cache-memory = "1GiB"`, `trust-remote-code = true`):

    ["qwen2.5-0.5b"]                  # a name with dots is quoted (TOML would nest the tables)
    model = "qwen2.5-0.5b-instruct-q8_0.gguf"
    max-model-len = 8192
    kv-cache-memory = "1GiB"

    [smollm2]
    model = "HuggingFaceTB/SmolLM2-360M-Instruct"
    quantize = "q8_0"
    speculative = "ngram"
    pin = true

A key a model cannot have on its own (a server-wide flag), an unknown key, a value of the wrong type
or out of range: a ValueError naming the file, the table, the key, what is allowed and what was given
(app.py prints it as one line and exits 2). Settings a table leaves out are the server's flags.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

# The flags a model's table may set (Settings fields): what its engine is built from.
PER_MODEL = ("dtype", "device", "quantize", "activations", "trust_remote_code", "block_size", "num_kv_blocks",
             "kv_cache_memory", "kv_cache_dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
             "max_queue", "seed", "speculative", "draft_model", "num_speculative_tokens", "speculative_max_seqs")
_LOW = {"block_size": 1, "num_kv_blocks": 2, "max_model_len": 2, "max_num_seqs": 1, "max_num_batched_tokens": 1,
        "max_queue": 0, "seed": 0, "num_speculative_tokens": 1, "speculative_max_seqs": 1}  # the engine's bounds
_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")


@dataclass(frozen=True, slots=True)
class Preset:
    """One model's table: its name, what is loaded, and the settings it sets (Settings field -> value)."""

    name: str
    source: str
    settings: tuple[tuple[str, object], ...]  # (Settings field, value) in the file's order
    shown: tuple[tuple[str, object], ...]  # (key, value as the file gave it): what /v1/models shows
    pinned: bool = False


def _key(field: str) -> str:
    return field.replace("_", "-")


def _choices(field: str) -> tuple[str, ...] | None:
    """The values an enumerated setting takes (the engine's own lists)."""
    if field in ("kv_cache_dtype", "speculative"):
        from engine.config import KV_CACHE_DTYPES, SPECULATIVE_MODES

        return KV_CACHE_DTYPES if field == "kv_cache_dtype" else SPECULATIVE_MODES
    if field in ("dtype", "quantize", "activations"):
        from engine.model.loading import ACTIVATIONS_CHOICES, DTYPE_CHOICES, QUANTIZE_CHOICES

        return {"dtype": DTYPE_CHOICES, "quantize": QUANTIZE_CHOICES, "activations": ACTIVATIONS_CHOICES}[field]
    return None


def _value(field: str, kind, given):
    """The setting's value from its TOML value; ValueError saying what the key takes."""
    from frontend.options import parse_size

    if kind == "bool":
        if isinstance(given, bool):
            return given
        raise ValueError("must be true or false")
    if kind is int:
        if not isinstance(given, int) or isinstance(given, bool):
            raise ValueError(f"must be an integer >= {_LOW.get(field, 0)}")
        if given < _LOW.get(field, 0):
            raise ValueError(f"must be an integer >= {_LOW[field]}")
        return given
    if kind == "size":  # bytes as a string ("1GiB") or a number, or a fraction of free memory
        if isinstance(given, bool) or not isinstance(given, (str, int, float)):
            raise ValueError('must be bytes like "1GiB" or 512000000, or a fraction of free memory like 0.5')
        try:
            value = parse_size(str(given))
        except ValueError:
            value = 0
        if value <= 0:
            raise ValueError('must be bytes like "1GiB" or 512000000, or a fraction of free memory like 0.5')
        return value
    if not isinstance(given, str) or not given.strip():
        raise ValueError("must be a string")
    choices = _choices(field)
    if choices is not None and given not in choices:
        raise ValueError(f"must be one of {', '.join(choices)}")
    if field == "device" and not _DEVICE.match(given):
        raise ValueError("must be auto, cpu, cuda or cuda:N")
    return given


def read_presets(path: str) -> list[Preset]:
    """The models of a preset file, in its order (see the module docstring). Raises ValueError."""
    from frontend.options import OPTIONS

    file = Path(path).expanduser()
    where = f"--models-preset {path}"
    try:
        tables = tomllib.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"--models-preset must be a TOML file with one [table] per model. Given: {path!r}, "
                         "which does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where} cannot be read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{where} is not valid TOML: {exc}") from None
    options = {opt.dest: opt for opt in OPTIONS}
    allowed = ", ".join(["model", "pin", *(_key(f) for f in PER_MODEL)])
    presets = []
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise ValueError(f"{where}: `{name}` is set outside any table; each setting belongs to one model's "
                             f'[table] (e.g. [my-model] then model = "/path/to/model.gguf"). Given: {name} = {table!r}')
        section = f'{where}: [{name}]' if re.fullmatch(r"[A-Za-z0-9_-]+", name) else f'{where}: ["{name}"]'
        nested = next((key for key, given in table.items() if isinstance(given, dict)), None)
        if nested is not None:
            raise ValueError(f"{section} holds a table `{nested}`: a model's name with a dot is quoted "
                             f'(["{name}.{nested}"]), else TOML reads it as tables inside tables')
        if "model" not in table:
            raise ValueError(f'{section} has no `model`: say what it loads (model = "file.gguf", a model folder '
                             f"or a Hub id). Keys it may have: {allowed}")
        settings, shown, pinned, source = [], [], False, None
        for key, given in table.items():
            if key == "model":
                if not isinstance(given, str) or not given.strip():
                    raise ValueError(f'{section} `model` must be a string: a .gguf file, a model folder or a Hub '
                                     f"id. Given: {given!r}")
                local = file.parent / Path(given).expanduser()  # a relative path is from the file's folder
                source = str(local) if not Path(given).expanduser().is_absolute() and local.exists() else given
                continue
            if key == "pin":
                if not isinstance(given, bool):
                    raise ValueError(f"{section} `pin` must be true or false. Given: {given!r}")
                pinned = given
                continue
            field = key.replace("-", "_")
            if field not in PER_MODEL:
                what = (f"is a server-wide setting (--{key}), not one model's"
                        if field in options and options[field].flag == f"--{key}" else "is not a setting")
                raise ValueError(f"{section} `{key}` {what}. Keys a model's table may have: {allowed}. "
                                 f"Given: {key} = {given!r}")
            try:
                value = _value(field, options[field].kind, given)
            except ValueError as exc:
                raise ValueError(f"{section} `{key}` {exc}. Given: {given!r}") from None
            settings.append((field, value))
            shown.append((key, given))
        presets.append(Preset(name, source, tuple(settings), tuple(shown), pinned))
    if not presets:
        raise ValueError(f"{where} names no model: give one [table] per model, each with its `model`")
    return presets
