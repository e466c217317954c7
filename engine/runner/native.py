"""A decode step of a Llama-family model without Python per layer (csrc/decode_layer.c).

When a step's tokens are decodes and prompt chunks that attend to no more positions than one
prompt of `EngineConfig.native_prefill_tokens` tokens would (many short prompts, say),
`PagedRunner` hands it to `NativeDecoder`: the embedding and the model's own rotary module (so any
RoPE variant it has) in torch, then one C call for the whole rest of the step: every decoder layer
(a prompt token attends as a decode would, to the positions up to its own), the final norm and the
output head of the rows that sample. One call, not one per layer: the engine thread leaves and
re-takes the interpreter lock once a step, so the event loop never holds it up between layers.
Longer prompt chunks, and every model it
does not take, keep transformers' modules. It takes a model only when each piece is what the C
layer computes: `LlamaForCausalLM` (Llama, SmolLM), `MistralForCausalLM` (its sliding window),
`Qwen2ForCausalLM` (q/k/v biases, a window per layer type) and `Qwen3ForCausalLM` (q/k norms),
with RMSNorm and SiLU, and every linear already on a C kernel (float32 panels or blocks). Otherwise
it says why and the runner keeps the modules (the same tokens, more Python). A head that is not on
a C kernel runs in torch after the call.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch
from torch import nn

from engine.kernels.build import checked_kernel
from engine.kernels.decode_step import DecodeStepKernel, Layer, Lin
from engine.kernels.qlinear import INT8_KIND, KINDS
from engine.model.linears import PanelLinear
from engine.model.panels import panels_of_blocks, q8_0_blocks_of_panels
from engine.model.quant import FusedPart, FusedProjections, QuantLinear
from engine.runner.step_output import StepOutput

log = logging.getLogger("rill.engine")


def _lin(module) -> tuple[Lin, int, object]:
    """The C description of a projection module: (struct, the width the kernel writes, owner kept alive)."""
    if not isinstance(module, (PanelLinear, QuantLinear, FusedProjections)):
        raise TypeError(type(module).__name__)
    if isinstance(module, PanelLinear):  # float32, bfloat16 or float16 panels (csrc/rill_kernels.h)
        kind = {torch.float32: -1, torch.bfloat16: -2, torch.float16: -3}[module.panels.dtype]
    else:
        kind = KINDS[module.kind] + (INT8_KIND if module.int8 else 0)
    bias = module.bias.data_ptr() if module.bias is not None else None
    width = module.out_features  # for a fused group: its padded parts end to end
    return Lin(module.panels.data_ptr(), bias, width, module.in_features, kind), width, module


def _projections(module: nn.Module, names: tuple[str, ...]):
    """(structs, n, offsets of each part in the output row) for q/k/v or gate/up."""
    parts = [getattr(module, name) for name in names]
    if all(isinstance(p, FusedPart) for p in parts) and len({id(p.group) for p in parts}) == 1:
        group = parts[0].group
        lin, _, holder = _lin(group)
        offsets = [sum(group.widths[:i]) for i in range(len(parts))]
        return (Lin * 1)(lin), 1, offsets, [holder]
    lins, holders = [], []
    for part in parts:
        lin, _, holder = _lin(part)
        lins.append(lin)
        holders.append(holder)
    return (Lin * len(lins))(*lins), len(lins), None, holders


STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # rotary scalings that depend on the position alone

# one layer shape, four names (Qwen3: an RMSNorm on each head of q and k)
NATIVE_MODELS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def _window(model, attention) -> int:
    """The layer's sliding window in tokens, 0 for none, as the model passes it to attention."""
    if type(model).__name__ == "MistralForCausalLM":
        return int(getattr(model.config, "sliding_window", None) or 0)
    return int(getattr(attention, "sliding_window", None) or 0)  # Qwen2: per layer type; Llama: none


def why_not_native(model) -> str | None:
    """None when `NativeDecoder` can take `model`, else the reason."""
    from transformers.activations import SiLUActivation

    if type(model).__name__ not in NATIVE_MODELS:
        return f"{type(model).__name__} is not one of {', '.join(NATIVE_MODELS)}"
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return "not a float32 CPU model"
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(mlp.act_fn, (nn.SiLU, SiLUActivation)):
            return f"activation {type(mlp.act_fn).__name__} is not SiLU"
        for norm in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)):
            if norm is not None and getattr(norm, "variance_epsilon", None) != layer.input_layernorm.variance_epsilon:
                return "a q/k norm whose epsilon is not the layer norm's"
        try:
            _projections(attn, ("q_proj", "k_proj", "v_proj"))
            _projections(mlp, ("gate_proj", "up_proj"))
            _lin(attn.o_proj), _lin(mlp.down_proj)
        except TypeError as exc:
            return f"a linear ({exc}) is not on a C kernel"
    return None


def _head(model):
    """(the final norm's weight, its epsilon, the output head's C struct and owner) when the C step can
    end with them (an RMSNorm and a head on a C kernel), else None: the model's own modules do."""
    norm, head = model.model.norm, model.lm_head
    if getattr(norm, "weight", None) is None or getattr(norm, "variance_epsilon", None) is None or \
            type(norm).__name__ not in ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"):
        return None
    try:
        lin, width, owner = _lin(head)
    except TypeError:
        return None
    return norm.weight, float(norm.variance_epsilon), lin, width, owner


# sampling rows from which a Q8_0 head is screened (one row: the whole head is faster), and past the
# rows the block kernel widens the weights for in registers (AVX2: up to 6, csrc/qlinear.c's
# rows_panel), where the whole head is faster too (bench.verify_cost)
SCREEN_ROWS = 2


def _screen(head) -> tuple | None:
    """For a head of Q8_0 blocks with float32 activations and no bias: the same blocks for the int8
    kernel, and each output's norm |w_o| (float32, rounded up, padded to the panels), with which
    csrc/decode_layer.c finds a greedy row's argmax from a few of the float32 outputs (see
    screened_argmax there); None for any other head. (A bias would add a rounding of the whole
    logit that the bound there does not count.)"""
    import numpy as np

    if not isinstance(head, QuantLinear) or head.kind != "q8_0" or head.int8 or head.bias is not None:
        return None
    out = head.out_features
    q, d = q8_0_blocks_of_panels(head.panels, out, head.in_features // 32)
    # each output's |w| = sqrt(sum over blocks of d^2 sum(q^2)), padded to the panels, rounded up; the
    # squares of q as integers, a slice of outputs at a time (a float64 copy of the head was 226 MB)
    squares = np.empty(q.shape[:2])  # [out, block]
    for start in range(0, out, 4096):
        part = q[start:start + 4096].astype(np.int32)
        squares[start:start + 4096] = (part * part).sum(axis=2)
    norms = np.zeros(head.panels.shape[0] * 16)
    norms[:out] = np.sqrt((squares * d.astype(np.float64) ** 2).sum(axis=1)) * (1 + 1e-6)
    head8 = panels_of_blocks(q, d, None, "q8_0", int8=True)
    lin = Lin(head8.data_ptr(), None, out, head.in_features, KINDS["q8_0"] + INT8_KIND)
    norms = torch.from_numpy(norms.astype(np.float32))
    return lin, norms, (head8, norms)


class NativeDecoder:
    """The decode step of a Llama-family model on csrc/decode_layer.c: one C call per step."""

    def __init__(self, model, kernel: DecodeStepKernel):
        self.model = model
        self._fn = kernel.fn
        config = model.config
        self.hidden = config.hidden_size
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or self.hidden // self.heads
        self.intermediate = config.intermediate_size
        self.threads = torch.get_num_threads()
        self._keep = []  # the modules whose buffers the structs point into
        self.widest = 0
        layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, n_qkv, qkv_offsets, held = _projections(attn, ("q_proj", "k_proj", "v_proj"))
            gu, n_gu, gu_offsets, held2 = _projections(mlp, ("gate_proj", "up_proj"))
            o, _, o_holder = _lin(attn.o_proj)
            down, _, down_holder = _lin(mlp.down_proj)
            norms = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
            self._keep += [qkv, gu, o, down, *held, *held2, o_holder, down_holder, *norms]
            q_off, k_off, v_off = qkv_offsets or (0, 0, 0)
            q_norm, k_norm = (None if n is None else n.weight.data_ptr()  # Qwen3's; the model keeps the weights
                              for n in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)))
            layers.append(Layer(
                norm1=norms[0].data_ptr(), norm2=norms[1].data_ptr(), qkv=qkv, o=ctypes.pointer(o), gate_up=gu,
                down=ctypes.pointer(down), q_norm=q_norm, k_norm=k_norm, n_qkv=n_qkv, q_off=q_off, k_off=k_off,
                v_off=v_off, n_gu=n_gu, up_off=(gu_offsets or (0, 0))[1], window=_window(model, attn),
                eps=float(layer.input_layernorm.variance_epsilon), scale=float(attn.scaling)))
            widths = sum(qkv[i].out for i in range(n_qkv)), sum(gu[i].out for i in range(n_gu))
            self.widest = max(self.widest, *widths)
        self.layers = (Layer * len(layers))(*layers)
        self._cache = None  # the paged cache whose tensors self.layers points into
        self.head = _head(model)  # None: the model's norm and lm_head end the step
        self._screen = _screen(self.head[4]) if self.head is not None else None  # (int8 head, norms, owners)
        # past the kernel's register-widened rows (beside SCREEN_ROWS, which tests raise)
        self._screen_from = self.head[4].kernel.few_rows + 1 if self._screen is not None else 0
        self._failed = ctypes.c_int(0)
        self._screened = ctypes.c_int64(-1)
        self.screened_steps = self.screened_panels = 0  # steps whose head was screened, the panels they computed
        # cos/sin of every position so far, from the model's rotary module once, when they depend on
        # the position alone (not "dynamic" or "longrope" scaling, which change with the length)
        self._static_rope = getattr(model.model.rotary_emb, "rope_type", "default") in STATIC_ROPE
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [rows, head_dim] of `positions`: rows of a table the rotary module computed (the
        same elementwise operations per position, so the same values; a module call took 54 us)."""
        rotary = self.model.model.rotary_emb
        if not self._static_rope:
            cos, sin = rotary(x[None], positions[None])
            return cos[0].contiguous(), sin[0].contiguous()
        need = int(positions.max()) + 1
        have = 0 if self._rope_table is None else self._rope_table[0].shape[0]
        if have < need:
            size = max(need, 2 * have, 512)
            cos, sin = rotary(x[:1][None], torch.arange(size)[None])
            self._rope_table = (cos[0].contiguous(), sin[0].contiguous())
        cos, sin = self._rope_table
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def _bind(self, cache) -> None:
        """Point each layer at its K/V tensors of `cache` (once per cache)."""
        if self._cache is not cache:
            for index, layer in enumerate(self.layers):
                layer.k_cache, layer.v_cache = cache.keys[index].data_ptr(), cache.values[index].data_ptr()
            self._cache = cache

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, cache, slot_mapping: torch.Tensor,
            token_slots: torch.Tensor, token_lens: torch.Tensor, keep: torch.Tensor | None = None,
            argmax_only: bool = False) -> StepOutput:
        """input_ids, positions, slot_mapping, token_lens: [rows] int64; token_slots: [rows, width]
        int64 (row r attends token_slots[r, :token_lens[r]]: a decode token its whole context, a
        prompt token the positions up to its own); keep: [samples] int64, ascending, the rows whose
        logits are wanted (None: all). Returns float32 logits [samples, vocab]; when the C step ran
        the head, with their argmax [samples] int64, each row's first largest logit (-1: a logit
        that is not finite), which the sampler uses for greedy rows it leaves unchanged.
        argmax_only (every sampling row is plain greedy, engine/sampler.py): from SCREEN_ROWS rows
        with a Q8_0 head, only the argmax is computed exactly and the output is `screened`: the
        logits hold the int8 kernel's, not the float32 product."""
        model = self.model
        rows = input_ids.shape[0]
        self._bind(cache)
        x = model.model.embed_tokens(input_ids).contiguous()  # [rows, hidden]
        cos, sin = self._rope(x, positions)  # [rows, head_dim]
        qd = self.heads * self.head_dim
        scratch = torch.empty(rows * (2 * self.hidden + qd + self.widest + 2 + self.intermediate))
        slot_mapping, token_slots, token_lens = (t.contiguous() for t in (slot_mapping, token_slots, token_lens))
        samples = rows if keep is None else keep.shape[0]
        logits = head = keep_ptr = best = None
        screen = self._screen if argmax_only and samples >= max(SCREEN_ROWS, self._screen_from) else None
        if self.head is not None:
            norm, eps, head, width, _ = self.head
            logits = torch.empty(samples, width)
            best = torch.empty(samples, dtype=torch.long)
            keep_ptr = None if keep is None else keep.contiguous().data_ptr()
        status = self._fn(
            self.layers, len(self.layers), x.data_ptr(), rows, self.hidden, self.intermediate, cos.data_ptr(),
            sin.data_ptr(), slot_mapping.data_ptr(), token_slots.data_ptr(), token_slots.shape[1],
            token_lens.data_ptr(), self.heads, self.kv_heads, self.head_dim, scratch.data_ptr(), self.threads,
            keep_ptr, samples, None if head is None else norm.data_ptr(), 0.0 if head is None else eps,
            None if head is None else ctypes.byref(head), None if head is None else logits.data_ptr(),
            None if head is None else best.data_ptr(), None if screen is None else ctypes.byref(screen[0]),
            None if screen is None else screen[1].data_ptr(), ctypes.byref(self._screened), ctypes.byref(self._failed))
        if status == -2:
            raise MemoryError(f"the native decode step could not allocate its buffers for {rows} rows")
        if status != 0:
            raise RuntimeError(f"the native decode step refused its arguments (layer {self._failed.value})")
        if head is not None:
            screened = screen is not None and self._screened.value >= 0  # then: int8 logits
            if screened:
                self.screened_steps += 1
                self.screened_panels += self._screened.value
            return StepOutput(logits, best, screened)  # best: -1 where a row is not finite (engine/sampler.py)
        if keep is not None:
            x = x.index_select(0, keep)
        x = model.model.norm(x)
        return StepOutput(model.lm_head(x).float())


def _decode_step_agrees(kernel: DecodeStepKernel) -> bool:
    """A tiny random Llama (2 layers, grouped queries, 6 tokens) on the C linears: every token of
    a prompt run through the native step as a decode (each attending to the positions up to its
    own) gives the logits of the model's own forward over the whole prompt."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.attention import PagedKVCache
    from engine.kernels.linear import LinearKernel
    from engine.model.linears import pack_linears

    torch.manual_seed(0)  # the model's initialisation; the caller's generator state is restored below
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="eager")
    model = LlamaForCausalLM(config).eval()
    tokens = torch.randint(0, 64, (6,))
    with torch.inference_mode():
        want = model(input_ids=tokens[None], use_cache=False).logits[0].float()  # [6, vocab]
    pack_linears(model, LinearKernel(kernel.library, kernel.path))
    cache = PagedKVCache(2, 2, 8, 2, 8, torch.float32, torch.device("cpu"))
    positions = torch.arange(6)
    slots = positions.repeat(6, 1)  # [6, 6]: row r attends slots 0..r
    got = NativeDecoder(model, kernel).run(tokens, positions, cache, positions, slots, positions + 1)
    return bool(torch.allclose(got.logits, want, atol=1e-4, rtol=1e-4))


def native_decode_kernel(cache_dir: Path) -> DecodeStepKernel | None:
    """The compiled native decode step once it passed its probe (a tiny random float32 Llama with
    grouped queries through `NativeDecoder` against its own forward), or None with the reason logged."""
    rng = torch.random.get_rng_state()
    try:
        return checked_kernel(DecodeStepKernel, _decode_step_agrees, cache_dir, "native decode step",
                              "transformers' modules", "transformers' modules")
    finally:
        torch.random.set_rng_state(rng)
