"""A model's module tree built on the meta device (no memory, no initialization), and each of its
tensors put in place afterwards: what both lean loaders (engine/model/gguf.py,
engine/model/safetensors_lean.py) build a model with."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from engine.model.errors import ModelLoadError


@contextlib.contextmanager
def parameters_on_meta():
    """Modules built inside get their parameters on the meta device (no memory, no initialization
    work); buffers (rotary frequencies) are computed as usual."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=False)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def set_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Put `tensor` where the (meta) parameter or buffer `name` is, checking its shape."""
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    current = module._parameters.get(leaf, module._buffers.get(leaf))
    if current is None:
        raise ModelLoadError(f"the GGUF tensor for {name!r} has no place in the model built from its config")
    if tuple(current.shape) != tuple(tensor.shape):
        raise ModelLoadError(f"the GGUF tensor for {name!r} has shape {tuple(tensor.shape)}; the model built from "
                             f"its config expects {tuple(current.shape)}: the file's metadata and tensors disagree")
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
    else:
        module._buffers[leaf] = tensor
