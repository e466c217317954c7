"""RILL_KERNEL_MARCH: the kernels built for a named instruction set (x86-64-v3, the AVX2 route that
most laptops take) in a library of their own, which runs that route even where the CPU has more."""

import platform
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or "avx2" not in Path("/proc/cpuinfo").read_text(),
    reason="x86-64-v3 code runs on an x86-64 CPU with AVX2")


def test_an_avx2_build_is_its_own_library_and_runs_no_avx512(tmp_path, monkeypatch, caplog):
    import engine.kernels as cpu
    from engine.kernels.sampling import sampling_kernel
    from engine.sampler import _draw
    from engine.model.quant_probe import quant_kernel

    monkeypatch.setenv("RILL_KERNEL_MARCH", "x86-64-v3")
    with caplog.at_level("WARNING", logger="rill.engine"):
        found = (cpu.decode_attention_kernel(tmp_path), quant_kernel(tmp_path), sampling_kernel(tmp_path, _draw))
    assert all(k is not None for k in found), caplog.text  # each agrees with its reference in that build
    library, path = cpu.compiled_library(tmp_path)
    assert path.name.startswith("rill_kernels-x86-64-v3-")
    native = cpu.build.library_path(tmp_path, cpu.build._compiler(), "native")
    assert path != native and not native.exists()  # a build of its own; native's is not touched
    march, isa = cpu.build.built_for(library)
    assert march == "x86-64-v3"
    assert "AVX2" in isa and "FMA" in isa and not any(name.startswith(("AVX-512", "AMX")) for name in isa), isa
    assert "AES" not in isa  # outside x86-64-v3, in any AVX2 CPU's -march=native: the flag was what compiled it
    assert found[1].isa == "AVX2"  # the block kernels report (and run) 256-bit vectors, whatever this CPU has


def test_a_march_that_is_no_compiler_value_is_refused(monkeypatch):
    from engine.kernels import build

    monkeypatch.setenv("RILL_KERNEL_MARCH", "native -O0; rm")
    with pytest.raises(ValueError, match="RILL_KERNEL_MARCH must be a compiler -march value.*given 'native -O0; rm'"):
        build.kernel_march()


@pytest.mark.embedded
@pytest.mark.skipif("avx512f" not in Path("/proc/cpuinfo").read_text(),
                    reason="without AVX-512 the native build is the AVX2 route, and every parity test runs it")
def test_the_avx2_route_equals_generate_where_the_cpu_has_more(tmp_path, monkeypatch):
    """On an AVX-512 or AMX host, the x86-64-v3 build (what a laptop runs) in a cache of its own:
    a Llama whose matrices cycle through every block type, twelve sequences decoding side by side
    (steps of 12 rows down to 1: each few-row path) beside chunked prompts, against `generate`."""
    from tests.test_gguf_parity import PROMPTS, TYPES, greedy, transformers_model
    from tests.test_gguf_file import tiny_llama
    from bench.gguf_file import LlamaShape, tensor_shapes, write_llama_gguf
    from engine import LLM, EngineConfig, SamplingParams
    from engine.model.loading import load_model

    monkeypatch.setenv("RILL_KERNEL_MARCH", "x86-64-v3")
    monkeypatch.setenv("RILL_CACHE", str(tmp_path / "cache"))
    model = tiny_llama(hidden=256, ffn=512, tied=False)
    matrices = [n for n, dims in tensor_shapes(LlamaShape.from_config(model.config)).items() if len(dims) == 2]
    types = {name: TYPES[i % len(TYPES)] for i, name in enumerate(matrices)}
    path = write_llama_gguf(model, None, tmp_path / "every-type.gguf", types=types)
    reference = transformers_model(path)
    loaded = load_model(str(path))
    assert "blocks from the GGUF" in loaded.weights, loaded.weights
    llm = LLM(loaded, EngineConfig(max_num_batched_tokens=64))
    assert any(p.name.startswith("rill_kernels-x86-64-v3-") for p in (tmp_path / "cache" / "kernels").iterdir())
    prompts = PROMPTS + [[(211 + 37 * i + 5 * j) % 3000 + 40 for j in range(2 + (7 * i) % 11)] for i in range(7)]
    lengths = [16 - i for i in range(len(prompts))]  # one sequence finishing per step towards the end
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    for prompt, got, n in zip(prompts, llm.generate(prompts, params), lengths):
        assert got.token_ids == greedy(reference, prompt)[:n], f"prompt of {len(prompt)} tokens, {n} out, diverged"
