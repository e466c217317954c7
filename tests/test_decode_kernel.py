"""The C decode-attention kernel (engine/csrc) against the torch path of `paged_attention`."""

import pytest
import torch

from engine.attention import PagedKVCache, StepMetadata, paged_attention
from engine.cpu import decode_attention_kernel


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    built = decode_attention_kernel(tmp_path_factory.mktemp("rill-cache"))
    assert built is not None, "the kernel did not build (a C compiler with OpenMP is needed)"
    assert built.path.exists()
    return built


class _Layer:
    layer_idx = 0


def _attend(kernel, heads, kv_heads, head_dim, lens, window=None, softcap=None, seed=0):
    """Both paths on one random step of decodes; returns (kernel output, torch output)."""
    gen = torch.Generator().manual_seed(seed)
    block, num_blocks = 16, 128
    cache = PagedKVCache(1, num_blocks, block, kv_heads, head_dim, torch.float32, torch.device("cpu"))
    cache.keys[0].copy_(torch.randn(cache.keys[0].shape, generator=gen))
    cache.values[0].copy_(torch.randn(cache.values[0].shape, generator=gen))
    width = max(lens)
    tables = torch.randperm(num_blocks, generator=gen)[:len(lens) * ((width + block - 1) // block)]
    tables = tables.view(len(lens), -1)
    pos = torch.arange(width)
    slots = tables[:, pos // block] * block + pos % block  # [B, width]
    last = torch.tensor([slots[b, n - 1] for b, n in enumerate(lens)])
    q = torch.randn(1, len(lens), heads, head_dim, generator=gen).transpose(1, 2)  # [1, heads, B, D]
    k = torch.randn(1, len(lens), kv_heads, head_dim, generator=gen).transpose(1, 2)
    v = torch.randn(1, len(lens), kv_heads, head_dim, generator=gen).transpose(1, 2)
    outs = []
    for use_kernel in (True, False):
        step = StepMetadata(cache=cache, slot_mapping=last, decode_token_index=torch.arange(len(lens)),
                            decode_slots=slots.contiguous(), decode_context_lens=torch.tensor(lens),
                            decode_kernel=kernel if use_kernel else None)
        out, _ = paged_attention(_Layer(), q, k, v, None, scaling=head_dim ** -0.5, rill_step=step,
                                 sliding_window=window, softcap=softcap)
        outs.append(out)
    return outs


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 4, 64), (4, 4, 32), (8, 1, 24), (6, 2, 128)])
def test_kernel_equals_torch_path(kernel, heads, kv_heads, head_dim):
    # lengths below, at and across the kernel's 32-position tiles and the 16-token blocks
    got, want = _attend(kernel, heads, kv_heads, head_dim, [1, 31, 32, 33, 100, 7, 64, 129])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_kernel_sliding_window_and_softcap(kernel):
    lens = [1, 5, 40, 97, 200]
    for window, softcap in ((8, None), (33, None), (None, 2.0), (16, 30.0)):
        got, want = _attend(kernel, 8, 2, 64, lens, window=window, softcap=softcap, seed=1)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    # the window changes the answer, so both paths really applied it
    windowed, _ = _attend(kernel, 8, 2, 64, lens, window=8, seed=1)
    full, _ = _attend(kernel, 8, 2, 64, lens, seed=1)
    assert not torch.allclose(windowed[0, 3], full[0, 3])


def test_kernel_alone_with_one_sequence_uses_every_thread_path(kernel):
    """One sequence (tasks split per KV head) and many (one task per sequence) agree with torch."""
    for lens in ([300], [3] * 40):
        got, want = _attend(kernel, 8, 4, 64, lens, seed=2)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_build_is_cached(kernel, tmp_path_factory):
    again = decode_attention_kernel(kernel.path.parent.parent)
    assert again is not None and again.path == kernel.path
