"""Architectures people deploy, beyond the parity suite's seven: each takes a fast path verified at
load against the model's own forward, or the fallback, and gives `generate`'s greedy tokens.

gpt-oss: attention sinks (`s_aux`), a mixture of experts, sliding and full layers in turn, YaRN.
StableLM: its decoder layers pass no keyword arguments to their attention, so the paged path's step
metadata never reaches it: detected at load, the fallback path, never a failure per request.
"""

import pytest
import torch

from engine import LLM, EngineConfig
from engine.model.loading import load_model
from engine.runner.probe import check_paged_path
from tests.test_engine_parity import engine_outputs, prompts_and_refs

SINKS_LABEL = "torch (gathered per step): attention sinks, which the decode kernels do not take"


@pytest.mark.parametrize("arch, runner, decode_attention", [
    ("gptoss", "paged", SINKS_LABEL),
    ("stablelm", "fallback", "transformers' own (the fallback path)")])
def test_deployed_architectures_equal_generate_batched_and_alone(tiny_model, arch, runner, decode_attention):
    path, prompts, refs = prompts_and_refs(tiny_model, arch)
    llm = LLM(load_model(str(path)), EngineConfig(max_num_batched_tokens=128))
    assert llm.core.attention_path == runner and llm.core.decode_attention == decode_attention
    assert (llm.core.runner_reason is None) == (runner == "paged")
    got = engine_outputs(llm, prompts)  # 16 prompts of 1 to 300 tokens in one busy batch
    for n, g, r in zip(map(len, prompts), got, refs):
        assert g == r, f"{arch}: prompt of {n} tokens diverged in the batch"
    for i in (0, 6, 15):  # alone
        assert engine_outputs(llm, [prompts[i]]) == [refs[i]], f"{arch}: prompt {i} diverged alone"
    assert llm.core.allocator.num_free == llm.core.num_kv_blocks


def test_stablelm_is_sent_to_the_fallback_at_load_with_the_reason(tiny_model):
    llm = LLM(load_model(str(tiny_model("stablelm"))))
    assert "step metadata" in llm.core.runner_reason and "StableLmAttention" in llm.core.runner_reason
    assert llm.core.model.config._attn_implementation != "rill_paged"  # back on its own attention


def test_the_probe_rejects_a_paged_path_that_drops_the_sinks(tiny_model, monkeypatch):
    """Without the sinks (as before this change) the paged logits differ from gpt-oss's own: the probe
    says so, and the model would take the fallback rather than answer wrongly."""
    model = load_model(str(tiny_model("gptoss"))).model
    good = check_paged_path(model, 16)
    assert good.reason is None and good.sinks and good.max_error < 1e-4
    monkeypatch.setattr("engine.attention._sink_rows", lambda *args: None)
    bad = check_paged_path(model, 16)
    assert bad.reason is not None and "differ from the model's own forward" in bad.reason, bad
    assert model.config._attn_implementation == "eager"  # gpt-oss's own (it has no SDPA)


class ZeroKernel:
    """A decode attention kernel that writes zeros: wrong for every model."""

    path = "zeros (test)"

    def __call__(self, query, out, *args):
        out.zero_()


def test_a_decode_kernel_that_fails_the_probe_leaves_the_torch_path(tiny_model, monkeypatch):
    monkeypatch.setattr("engine.model.setup.decode_attention_kernel", lambda cache_dir: ZeroKernel())
    path, prompts, refs = prompts_and_refs(tiny_model, "gemma2")
    llm = LLM(load_model(str(path)), EngineConfig(max_num_batched_tokens=128))
    assert llm.core.attention_path == "paged" and llm.core.runner.decode_kernel is None
    assert llm.core.decode_attention == "torch (gathered per step): the decode kernel failed the load-time probe"
    assert engine_outputs(llm, prompts[:4]) == refs[:4]
