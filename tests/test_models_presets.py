"""`--models-preset FILE` (frontend/presets.py): a TOML table per model with its own settings. A bad
file stops app.py at start with one line naming the table, the key, what is allowed and what was
given (exit 2, as a bad flag does); a good one gives each model its own settings. The models built
with them are tested over HTTP in tests/test_models_router.py (`short` and `long`)."""

from __future__ import annotations

import pytest

import app
from frontend.models import discover, settings_of


def start_fails(tmp_path, text: str | None, capsys, monkeypatch) -> str:
    """app.py's main with a preset file of `text` (None: no file): its exit status 2 and its one line."""
    monkeypatch.setattr(app.faulthandler, "register", lambda *args, **kwargs: None)  # capsys's stderr has no fd
    path = tmp_path / "models.toml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(SystemExit) as caught:
        app.main(["--models-preset", str(path)])
    assert caught.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("app.py: error: "), lines
    return lines[0]


@pytest.mark.parametrize("text, words", [
    (None, ["--models-preset must be a TOML file", "does not exist"]),
    ('[a]\nmodel = "m.gguf"\nport = 8000\n', ["[a] `port` is a server-wide setting (--port)", "max-model-len",
                                               "Given: port = 8000"]),
    ('[a]\nmodel = "m.gguf"\nmax-len = 512\n', ["[a] `max-len` is not a setting", "kv-cache-memory, kv-cache-dtype",
                                                "Given: max-len = 512"]),
    ('[a]\nmodel = "m.gguf"\nmax-model-len = "8k"\n', ["[a] `max-model-len` must be an integer >= 2", "Given: '8k'"]),
    ('[a]\nmodel = "m.gguf"\nnum-kv-blocks = 1\n', ["[a] `num-kv-blocks` must be an integer >= 2", "Given: 1"]),
    ('[a]\nmodel = "m.gguf"\nquantize = "q3"\n', ["[a] `quantize` must be one of auto, none, q8_0", "Given: 'q3'"]),
    ('[a]\nmodel = "m.gguf"\nkv-cache-memory = "lots"\n', ["[a] `kv-cache-memory` must be bytes", "Given: 'lots'"]),
    ('[a]\nmodel = "m.gguf"\npin = "yes"\n', ["[a] `pin` must be true or false", "Given: 'yes'"]),
    ('[a]\nmax-model-len = 512\n', ["[a] has no `model`"]),
    ('[qwen2.5]\nmodel = "m.gguf"\n', ['[qwen2] holds a table `5`', '(["qwen2.5"])']),
    ('model = "m.gguf"\n', ["`model` is set outside any table", "Given: model = 'm.gguf'"]),
    ('[a\nmodel = "m.gguf"\n', ["is not valid TOML", "line 1"]),
    ('[a]\nmodel = "m.gguf"\ndraft-model = "embedded"\n', ["[a] EngineConfig: draft_model is only used with "
                                                         "speculative='draft'"]),
    ('[a]\nmodel = "m.gguf"\n[b]\nmodel = "n.gguf"\npin = true\n', []),  # all good: the load of `a` fails
])
def test_a_bad_preset_stops_the_start_with_one_line_saying_what_is_wrong(tmp_path, text, words, capsys, monkeypatch):
    line = start_fails(tmp_path, text, capsys, monkeypatch)
    if not words:  # a good file: its first model (the default) is loaded at start, and m.gguf is no model
        assert "m.gguf" in line, line
    for word in words:
        assert word in line, line


def test_a_preset_gives_each_model_its_own_settings_over_the_servers(tmp_path):
    (tmp_path / "small.gguf").write_bytes(b"")
    (tmp_path / "models.toml").write_text(
        '[small]\nmodel = "small.gguf"\nmax-model-len = 4096\nkv-cache-memory = "1GiB"\nspeculative = "ngram"\n\n'
        '["qwen2.5-0.5b"]\nmodel = "Qwen/Qwen2.5-0.5B-Instruct"\nquantize = "q8_0"\npin = true\n')
    settings = app.parse_settings(["--models-preset", str(tmp_path / "models.toml"), "--max-num-seqs", "8"],
                                  environ={})
    small, qwen = discover(settings)
    assert (small.name, small.source, small.pinned) == ("small", str(tmp_path / "small.gguf"), False)
    assert (qwen.name, qwen.source, qwen.pinned) == ("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B-Instruct", True)
    built = settings_of(settings, small)
    assert (built.model_id, built.max_model_len, built.kv_cache_memory, built.speculative, built.max_num_seqs) == (
        str(tmp_path / "small.gguf"), 4096, 2**30, "ngram", 8)  # the server's flags where the table says nothing
    built = settings_of(settings, qwen)
    assert (built.quantize, built.max_model_len, built.speculative) == ("q8_0", None, "off")
    assert dict(small.shown) == {"max-model-len": 4096, "kv-cache-memory": "1GiB", "speculative": "ngram"}
