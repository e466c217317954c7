"""What a model gets when an engine core is built over it: its linears packed (once per model), a
paged runner with the decode kernels this host has, or the fallback runner."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.attention import kv_cache_dtype
from engine.config import EngineConfig, rill_cache_dir
from engine.host import keep_freed_memory
from engine.kernels.decode_attention import decode_attention_kernel
from engine.kernels.gpu import paged_decode_kernel
from engine.model.linears import describe_linears, prepare_linears
from engine.runner.fallback import FallbackRunner
from engine.runner.native import NativeDecoder, native_decode_kernel, why_not_native
from engine.runner.paged import PagedRunner
from engine.runner.probe import check_paged_path

log = logging.getLogger("rill.engine")


@dataclass(slots=True)
class ModelSetup:
    """A model made ready for one engine core."""

    runner: PagedRunner | FallbackRunner
    linears: str  # where the linears run, for /health and the log (engine.model.linears.describe_linears)
    decode_attention: str  # where decode attention runs, for /health and the log
    num_packed: int  # linears this setup packed (0 when an earlier core over the model did)
    runner_reason: str | None = None  # why the model takes the fallback runner (None: the paged path, verified)


def setup_model(model, config: EngineConfig, num_kv_blocks: int) -> ModelSetup:
    """Pack the linears (first core only), choose the decode kernels and build the runner: the paged one
    once a probe finds it gives the model's own logits (engine/runner/probe.py), else the fallback."""
    on_cpu = model.device.type == "cpu"
    if on_cpu:
        keep_freed_memory()
    num_packed = prepare_linears(model, config.packed_linears, config.linear_kernel)
    linears = describe_linears(model)
    kernel, kv_dtype = None, kv_cache_dtype(config.kv_cache_dtype, model.dtype)
    # the kernels read a cache of the model's dtype (the C one float32): another goes the torch path
    torch_why = None if kv_dtype == model.dtype else \
        f"a {str(kv_dtype).removeprefix('torch.')} KV cache, which the decode kernels do not read"
    if torch_why is None and on_cpu and config.decode_kernel and model.dtype == torch.float32:
        kernel = decode_attention_kernel(rill_cache_dir())
    elif torch_why is None and model.device.type == "cuda" and config.decode_kernel:
        kernel = paged_decode_kernel(model.device)
    check = check_paged_path(model, config.block_size, kv_dtype, decode_kernel=kernel)
    if check.reason is not None and kernel is not None:  # the paged path may hold without the kernel
        retry = check_paged_path(model, config.block_size, kv_dtype)
        if retry.reason is None:
            log.warning("engine: the decode kernel failed the load-time probe (%s)", check.reason)
            check, kernel, torch_why = retry, None, "the decode kernel failed the load-time probe"
    if check.reason is not None:
        log.warning("engine: %s takes the fallback path: %s", type(model).__name__, check.reason)
        return ModelSetup(FallbackRunner(model), linears, "transformers' own (the fallback path)", num_packed,
                          check.reason)
    if check.sinks and kernel is not None:
        kernel, torch_why = None, "attention sinks, which the decode kernels do not take"
    native = _native_decoder(model) if on_cpu and kernel is not None and config.native_decode else None
    runner = PagedRunner(model, num_kv_blocks, config.block_size, decode_kernel=kernel, native=native,
                         native_prefill_tokens=config.native_prefill_tokens, kv_dtype=kv_dtype)
    decode_attention = ("C (the native decode step)" if native is not None else
                        "Triton (the paged cache in place)" if runner.kernel_reads_blocks else
                        "C kernel" if kernel is not None else
                        "torch (gathered per step)" + (f": {torch_why}" if torch_why else ""))
    log.info("engine: decode attention %s", f"in the kernel {kernel.path}" if kernel else "on the torch path")
    return ModelSetup(runner, linears, decode_attention, num_packed)


def _native_decoder(model) -> NativeDecoder | None:
    """csrc/decode_layer.c for decode steps when it takes this model and passed its probe, else None."""
    reason = why_not_native(model)
    if reason is None:
        kernel = native_decode_kernel(rill_cache_dir())
        if kernel is None:
            reason = "the native step is unavailable (see above)"
        else:
            try:
                decoder = NativeDecoder(model, kernel)
                log.info("engine: decode steps in C (csrc/decode_layer.c), one call per step")
                return decoder
            except Exception as exc:  # a model piece the structs cannot describe
                reason = str(exc)
    log.info("engine: decode steps through transformers' modules (%s)", reason)
    return None
