"""The C kernels (engine/kernels/csrc): decode attention against the torch path of `paged_attention`,
the linear against `nn.Linear`."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import PagedKVCache, StepMetadata, paged_attention
from engine.config import rill_cache_dir
from engine.kernels import decode_attention_kernel, linear_kernel
from engine.model.linears import PackedLinear, PanelLinear, pack_linears


@pytest.fixture(scope="module")
def kernel():
    """The build the engine uses (this machine's, in $RILL_CACHE: one compile per run of the sources at most)."""
    built = decode_attention_kernel(rill_cache_dir())
    assert built is not None, "the kernel did not build (a C compiler with OpenMP is needed)"
    assert built.path.exists()
    return built


class _Layer:
    layer_idx = 0


def _attend(kernel, heads, kv_heads, head_dim, lens, window=None, softcap=None, seed=0, share=()):
    """Both paths on one random step of decodes; returns (kernel output, torch output). `share`:
    (b, a, n): sequence b's first n blocks are sequence a's (as the prefix cache gives them)."""
    gen = torch.Generator().manual_seed(seed)
    block = 16
    num_blocks = max(128, len(lens) * -(-max(lens) // block))
    cache = PagedKVCache(1, num_blocks, block, kv_heads, head_dim, torch.float32, torch.device("cpu"))
    cache.keys[0].copy_(torch.randn(cache.keys[0].shape, generator=gen))
    cache.values[0].copy_(torch.randn(cache.values[0].shape, generator=gen))
    width = max(lens)
    tables = torch.randperm(num_blocks, generator=gen)[:len(lens) * ((width + block - 1) // block)]
    tables = tables.view(len(lens), -1)
    for b, a, n in share:
        tables[b, :n] = tables[a, :n]
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
    """On 2 threads: one sequence of a short context (a task per KV head), of a long one (ranges of
    positions over whole rows), two of each, and many (one task per sequence) agree with torch,
    with heads of 64 (the AVX-512 code where the CPU has it) and of 24 (the portable code)."""
    threads, kernel.threads = kernel.threads, 2
    try:
        for heads, kv_heads, head_dim in ((8, 4, 64), (6, 3, 24)):
            for lens in ([100], [300], [100, 90], [600, 300], [3] * 40):
                got, want = _attend(kernel, heads, kv_heads, head_dim, lens, seed=2)
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    finally:
        kernel.threads = threads


def test_long_contexts_of_few_sequences_split_into_position_ranges_equal_the_torch_path(kernel):
    """One sequence of SmolLM2's 3 KV heads on 2 threads takes its context in ranges of positions
    whose softmax states are merged: the answer is the torch path's, with a window, a softcap, a
    shared prefix before the ranges, and a short sequence beside long ones (empty ranges)."""
    threads, kernel.threads = kernel.threads, 2
    try:
        cases = [([1000], {}), ([300], {"softcap": 20.0}), ([700], {"window": 100}), ([500, 20, 260], {}),
                 ([400, 380], {"share": [(1, 0, 20)]}), ([129], {})]
        for lens, options in cases:
            got, want = _attend(kernel, 9, 3, 64, lens, seed=5, **options)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    finally:
        kernel.threads = threads


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (8, 8, 32), (6, 2, 128)])
def test_a_shared_prefix_read_once_for_its_sequences_equals_the_torch_path(kernel, heads, kv_heads, head_dim):
    """Sequences whose first blocks are the same slots take the shared pass over them, then their
    own positions: the answer is the torch path's. Here: a group of five sharing 8 blocks (one
    whose only own position is its new token, one sharing 5 of them, so the group's run is 5
    blocks), a second group of two, one sharing 3 blocks (48 positions: too few, alone), others
    alone; and the same with a softcap."""
    lens = [200, 129, 300, 81, 150, 97, 140, 100, 60, 250]
    share = [(1, 0, 8), (2, 0, 8), (3, 0, 5), (4, 0, 8), (6, 5, 6), (7, 0, 3)]
    for softcap in (None, 20.0):
        got, want = _attend(kernel, heads, kv_heads, head_dim, lens, softcap=softcap, seed=3, share=share)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    # forty sequences on one 450-token prefix, as the shared-prefix benchmark's step
    lens = [450 + 3 * i for i in range(40)]
    got, want = _attend(kernel, heads, kv_heads, head_dim, lens, seed=4, share=[(b, 0, 28) for b in range(1, 40)])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("rows", [2, 5, 9])
def test_a_speculative_verification_of_one_sequence_equals_the_torch_path(kernel, rows):
    """A speculative step checks one sequence's last token and its guesses: rows at consecutive
    positions of the same slots. They take the shared pass split into ranges of positions (SmolLM2's
    3 KV heads on 2 threads), 6 or 15 query heads per KV head (one vector of queries, or two);
    the answer is the torch path's."""
    threads, kernel.threads = kernel.threads, 2
    try:
        lens = [600 - rows + 1 + i for i in range(rows)]
        share = [(b, 0, 38) for b in range(1, rows)]  # every block: the same sequence
        got, want = _attend(kernel, 9, 3, 64, lens, seed=6, share=share)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    finally:
        kernel.threads = threads


def test_build_is_cached(kernel):
    again = decode_attention_kernel(kernel.path.parent.parent)
    assert again is not None and again.path == kernel.path


@pytest.fixture(scope="module")
def linear(kernel):
    built = linear_kernel(kernel.path.parent.parent)  # the same library
    assert built is not None and built.path == kernel.path
    return built


def _layer(in_features: int, out_features: int, bias: bool, seed: int) -> nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    layer = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, in_features, generator=gen))
        if bias:
            layer.bias.copy_(torch.randn(out_features, generator=gen))
    return layer


@pytest.mark.parametrize("in_features, out_features", [(64, 48), (37, 10), (8, 1), (5, 7), (576, 1536), (2048, 515)])
def test_linear_kernel_equals_nn_linear(linear, in_features, out_features):
    """Row counts of decode steps and prefill chunks (whole tiles of 6 rows and every partial
    one), widths that are no multiple of 8, partial panels, with and without bias."""
    gen = torch.Generator().manual_seed(1)
    for bias in (False, True):
        layer = _layer(in_features, out_features, bias, seed=in_features * out_features)
        panel = PanelLinear(layer, linear)
        for rows in [*range(1, 14), 64, 130]:
            x = torch.randn(rows, in_features, generator=gen)
            with torch.no_grad():
                torch.testing.assert_close(panel(x), layer(x), atol=2e-4, rtol=1e-5)


def test_linear_kernel_reads_strided_rows_and_batches(linear):
    layer = _layer(64, 20, True, seed=3)
    panel = PanelLinear(layer, linear)
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(7, 96, generator=gen)[:, 16:80]  # a view: rows 96 floats apart
    assert not rows.is_contiguous()
    cols = torch.randn(64, 5, generator=gen).t()  # columns not contiguous: copied first
    batch = torch.randn(2, 3, 64, generator=gen)  # [batch, tokens, hidden], as a model calls it
    with torch.no_grad():
        for x in (rows, cols, batch):
            torch.testing.assert_close(panel(x), layer(x), atol=1e-4, rtol=1e-5)


def test_float32_linears_run_on_the_kernel_others_on_onednn(linear):
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    assert pack_linears(model, linear) == (2, "C kernel")
    assert isinstance(model[0], PanelLinear) and isinstance(model[2], PanelLinear)
    bf16 = nn.Sequential(nn.Linear(16, 8)).to(torch.bfloat16)
    assert pack_linears(bf16, linear)[1] != "C kernel" and not isinstance(bf16[0], PanelLinear)  # oneDNN or torch
    mixed = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 4).to(torch.bfloat16))
    assert pack_linears(mixed, linear)[1] != "C kernel" and not isinstance(mixed[0], PanelLinear)
    with pytest.raises(TypeError, match="float32"):
        PanelLinear(nn.Linear(16, 8), linear)(torch.ones(2, 16, dtype=torch.bfloat16))
    if torch.backends.mkldnn.is_available():  # without the C kernel: oneDNN
        plain = nn.Sequential(nn.Linear(16, 8))
        assert pack_linears(plain, None) == (1, "oneDNN") and isinstance(plain[0], PackedLinear)


def test_without_a_compiler_the_engine_says_so_and_uses_torch(tmp_path, monkeypatch, caplog, tiny_model):
    from engine import LLM, EngineConfig, SamplingParams
    from engine.model.loading import load_model

    monkeypatch.setenv("CC", "/bin/false")  # a compiler that fails: as good as none
    monkeypatch.setenv("RILL_CACHE", str(tmp_path))
    with caplog.at_level("INFO", logger="rill.engine"):
        llm = LLM(load_model(str(tiny_model("llama"))), EngineConfig())
        assert llm.core.runner.decode_kernel is None and llm.core.linears == "oneDNN"
        text = llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=8))[0].text
    assert text
    log = caplog.text
    assert "decode attention: the torch path (the C kernel is unavailable: /bin/false failed" in log
    assert "linears: oneDNN (the C kernel is unavailable" in log
    assert "decode attention on the torch path" in log


_POOL_PROBE = """
import os, sys, time, torch
from engine import AsyncEngine
from engine.model.loading import load_model

def threads():
    return len(os.listdir("/proc/self/task"))

engine = AsyncEngine(load_model(sys.argv[1]))
before = None
for _ in range(100):  # the passing threads' workers exit as those threads end
    time.sleep(0.05)
    now, before = before, threads()
    if now == before:
        break
torch.ones(1 << 23).mul_(3)  # a parallel region of torch.get_num_threads() threads, in this thread
print(threads() - before, torch.get_num_threads())
"""


def test_loading_and_building_an_engine_leave_the_callers_thread_without_an_openmp_pool(tiny_model):
    """libgomp keeps a pool of workers for each thread that ran a parallel region. A server's main
    thread loads and builds the engine, then lives on beside the engine's thread: holding a pool, it
    would put more workers than CPUs in the process, and every worker would then sleep at once at
    each barrier (engine/host.py, in_passing_thread). So after both, the first parallel region of
    the caller's own thread starts its workers: it had none."""
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("needs /proc (Linux)")
    out = subprocess.run([sys.executable, "-c", _POOL_PROBE, str(tiny_model("llama"))], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "2"},
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    started, team = map(int, out.stdout.split()[-2:])
    assert team == 2 and started == team - 1, out.stdout


def test_the_kernels_build_and_agree_without_avx2(portable_cache, portable_kernels, caplog):
    """A CPU without AVX2 gets the kernels' portable paths (GCC's generic vectors), built from the
    same sources: they compile and pass the start-up checks that every build passes."""
    from engine.model.quant_probe import quant_kernel

    cpu = portable_kernels
    with caplog.at_level("WARNING", logger="rill.engine"):
        found = (cpu.linear_kernel(portable_cache), cpu.decode_attention_kernel(portable_cache),
                 quant_kernel(portable_cache))
    assert all(k is not None for k in found), caplog.text
    library, path = cpu.compiled_library(portable_cache)
    assert path.parent == portable_cache / "kernels" and path.name.startswith("rill_kernels-x86-64-")
    assert library.rill_qlinear_vector_bits() == 0
