"""`python app.py`: readable --help, flags over environment variables over defaults (as a Space
passes settings), clear one-line failures with exit code 2."""

from __future__ import annotations

import subprocess

import pytest

import app
from frontend import options
from tests.servers import ROOT, clean_env, python


def run_app(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([python(), "app.py", *args], cwd=ROOT, env=clean_env(env), capture_output=True,
                          text=True, timeout=timeout)


def test_help_lists_every_flag_with_its_environment_variable_and_default():
    result = run_app("--help", timeout=60)
    assert result.returncode == 0
    text = result.stdout
    for flag, variable in (("--model", "MODEL_ID"), ("--port", "GRADIO_SERVER_PORT"), ("--host", "GRADIO_SERVER_NAME"),
                           ("--api-key", "API_KEY"), ("--max-num-seqs", "MAX_NUM_SEQS"), ("--max-queue", "MAX_QUEUE"),
                           ("--kv-cache-memory", "KV_CACHE_MEMORY"), ("--num-kv-blocks", "NUM_KV_BLOCKS"),
                           ("--dtype", "DTYPE"), ("--device", "DEVICE"), ("--request-timeout", "REQUEST_TIMEOUT"),
                           ("--resume-window", "RESUME_WINDOW"), ("--max-body-bytes", "MAX_BODY_BYTES"),
                           ("--shutdown-timeout", "SHUTDOWN_TIMEOUT"), ("--resume-max-streams", "RESUME_MAX_STREAMS"),
                           ("--resume-max-bytes", "RESUME_MAX_BYTES"), ("--speculative", "SPECULATIVE"),
                           ("--draft-model", "DRAFT_MODEL")):
        assert flag in text and variable in text, flag
    assert "7860" in text and "127.0.0.1" in text
    assert "--test-hooks" not in text  # test-only switch stays out of the help
    assert max(len(line) for line in text.splitlines()) <= 100


def test_defaults_are_what_a_space_needs():
    settings = app.parse_settings([], environ={})
    assert (settings.host, settings.port, settings.model_id) == ("127.0.0.1", 7860, None)
    assert settings.api_key is None and settings.cors_origins == () and not settings.trust_remote_code
    assert settings.resume_window == 30 and settings.default_max_new_tokens == 512


def test_environment_sets_and_flags_override():
    env = {"MODEL_ID": "org/model", "GRADIO_SERVER_NAME": "0.0.0.0", "GRADIO_SERVER_PORT": "9000",
           "API_KEY": "secret", "MAX_NUM_SEQS": "8", "MAX_QUEUE": "16", "KV_CACHE_MEMORY": "2GiB",
           "NUM_KV_BLOCKS": "300", "DTYPE": "bfloat16", "TRUST_REMOTE_CODE": "true", "CORS_ORIGINS": "https://a.b, https://c.d",
           "UI_AUTH": "me:pw", "REQUEST_TIMEOUT": "12.5"}
    settings = app.parse_settings([], environ=env)
    assert settings.model_id == "org/model" and settings.host == "0.0.0.0" and settings.port == 9000
    assert settings.api_key == "secret" and settings.max_num_seqs == 8 and settings.max_queue == 16
    assert settings.kv_cache_memory == 2 * 2**30 and settings.num_kv_blocks == 300 and settings.dtype == "bfloat16"
    assert settings.trust_remote_code is True and settings.cors_origins == ("https://a.b", "https://c.d")
    assert settings.ui_auth == ("me", "pw") and settings.request_timeout == 12.5
    flags = app.parse_settings(["--port", "7000", "--model", "other", "--no-trust-remote-code"], environ=env)
    assert (flags.port, flags.model_id, flags.trust_remote_code) == (7000, "other", False)
    assert app.parse_settings([], environ={"PORT": "8080"}).port == 8080  # a common alias
    bounds = app.parse_settings(["--resume-max-streams", "7"], environ={"RESUME_MAX_BYTES": "8MiB"})
    assert (bounds.resume_max_streams, bounds.resume_max_bytes) == (7, 8 * 2**20)
    spec = app.parse_settings(["--num-speculative-tokens", "6"],
                              environ={"SPECULATIVE": "draft", "DRAFT_MODEL": "embedded", "NUM_SPECULATIVE_TOKENS": "3"})
    assert (spec.speculative, spec.draft_model, spec.num_speculative_tokens) == ("draft", "embedded", 6)


@pytest.mark.parametrize("argv, env, words", [
    (["--port", "x"], {}, ["--port", "x"]),
    ([], {"MAX_NUM_SEQS": "many"}, ["MAX_NUM_SEQS", "many"]),
    ([], {"KV_CACHE_MEMORY": "lots"}, ["KV_CACHE_MEMORY", "lots"]),
    (["--max-num-seqs", "0"], {}, ["--max-num-seqs", "0"]),
    (["--port", "70000"], {}, ["--port", "70000"]),
    (["--ui-auth", "nopassword"], {}, ["--ui-auth", "USER:PASS"]),
    (["--resume-window", "-1"], {}, ["--resume-window", "-1"]),
    (["--resume-max-streams", "0"], {}, ["--resume-max-streams", "0"]),
    ([], {"RESUME_MAX_BYTES": "0.5"}, ["RESUME_MAX_BYTES", "0.5", "whole number of bytes"]),
    (["--speculative", "eagle"], {}, ["--speculative", "off, ngram, draft", "eagle"]),
    (["--speculative", "draft"], {}, ["--speculative draft needs --draft-model"]),
    ([], {"DRAFT_MODEL": "embedded"}, ["--draft-model is only used with --speculative draft", "embedded"]),
])
def test_bad_settings_exit_2_with_one_clear_line(argv, env, words, capsys):
    with pytest.raises(SystemExit) as caught:
        app.parse_settings(argv, environ=env)
    assert caught.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    for word in words:
        assert word in error, error


def test_size_parsing():
    assert options.parse_size("512MB") == 512e6
    assert options.parse_size("1.5GiB") == 1.5 * 2**30
    assert options.parse_size("0.5") == 0.5
    assert options.parse_size("1000000") == 1e6


def test_missing_model_exits_2_with_one_line_and_no_traceback(tmp_path):
    missing = tmp_path / "no-such-model"
    result = run_app("--model", str(missing), "--port", "7999")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("app.py: error:")]
    assert len(errors) == 1 and str(missing) in errors[0], result.stderr


def test_folder_without_config_exits_2(tmp_path):
    result = run_app("--model", str(tmp_path), "--port", "7999")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "config" in result.stderr


@pytest.mark.parametrize("args, env, name", [
    ((), {"API_KEY": "   "}, "API_KEY"),
    ((), {"API_KEY": "\t\n"}, "API_KEY"),
    (("--api-key", " "), {}, "--api-key"),
    (("--api-key", ""), {}, "--api-key"),
])
def test_an_api_key_of_only_whitespace_refuses_to_start(args, env, name, tmp_path):
    """It meant no key at all (every route open) without a word; now the process exits 2 saying why."""
    result = run_app(*args, "--model", str(tmp_path / "never-loaded"), "--port", "7999", env=env, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("app.py: error:")]
    assert len(errors) == 1 and name in errors[0] and "whitespace" in errors[0], result.stderr
    assert "every route" in errors[0]
