"""The Space configuration: README.md's YAML header against requirements.txt and app.py, and the variants."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("rill_spaces_deploy", ROOT / "spaces_config" / "deploy.py")
deploy = importlib.util.module_from_spec(_spec)  # spaces_config/deploy.py, not importable as a package
sys.modules[_spec.name] = deploy  # dataclasses look their module up there
_spec.loader.exec_module(deploy)

SPACE_COLORS = {"red", "yellow", "green", "blue", "indigo", "purple", "pink", "gray"}
VARIANTS = deploy.variant_names()


def hardware_names() -> set[str]:
    from huggingface_hub import SpaceHardware

    return {hw.value for hw in SpaceHardware}


@pytest.fixture(scope="module")
def front_matter() -> dict:
    header, _ = deploy.split_front_matter((ROOT / "README.md").read_text())
    return header


def app_reads(name: str) -> bool:
    """Whether app.py's settings depend on the environment variable `name` (the only way a Space's
    variables and secrets reach the app): given a value no setting takes, app.py either refuses it
    with an error that names the variable, or its settings change."""
    import app

    baseline = app.parse_settings([], environ={})
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            settings = app.parse_settings([], environ={name: "@not-a-value@"})
    except SystemExit:
        return f"environment variable {name}:" in errors.getvalue()
    return settings != baseline


def requirement_pin(name: str) -> str | None:
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        match = re.match(rf"^\s*{re.escape(name)}\s*==\s*([^\s;#]+)", line, re.IGNORECASE)
        if match:
            return match.group(1)
    return None


def test_front_matter_is_what_a_gradio_space_reads(front_matter):
    assert front_matter["sdk"] == "gradio"
    assert front_matter["app_file"] == "app.py"
    assert (ROOT / front_matter["app_file"]).is_file()
    assert front_matter["title"] and front_matter["emoji"]
    assert front_matter["colorFrom"] in SPACE_COLORS and front_matter["colorTo"] in SPACE_COLORS
    assert front_matter["pinned"] is False
    assert front_matter["license"] == "apache-2.0"
    assert 0 < len(front_matter["short_description"]) <= 60  # the Hub refuses longer ones
    assert front_matter["suggested_hardware"] in hardware_names()


def test_sdk_version_matches_the_gradio_pin(front_matter):
    pin = requirement_pin("gradio")
    assert pin is not None, "requirements.txt must pin gradio==X.Y.Z (the Space installs sdk_version)"
    assert str(front_matter["sdk_version"]) == pin


def test_installed_gradio_is_the_pinned_one():
    import gradio

    assert gradio.__version__ == requirement_pin("gradio")


def test_app_reads_the_variables_a_space_sets():
    for name in ("GRADIO_SERVER_NAME", "GRADIO_SERVER_PORT", "MODEL_ID"):
        assert app_reads(name), f"app.py does not read {name}"
    assert not app_reads("NOT_A_RILL_SETTING")  # the probe itself tells a variable nobody reads


def test_readme_opens_with_the_quickstart_after_the_header():
    _, body = deploy.split_front_matter((ROOT / "README.md").read_text())
    intro = body.split("\n## ")[0]
    assert intro.lstrip("\n").startswith("<!-- lead: quickstart -->") or ("make run" in intro and "make test" in intro)
    assert "\n## Serve another model" in body and "\n## Deploy as a Space" in body


@pytest.mark.parametrize("name", VARIANTS)
def test_variant_names_only_what_app_reads(name):
    variant = deploy.load_variant(name)
    assert variant.hardware in hardware_names()
    unread = [key for key in (*variant.variables, *variant.secrets) if not app_reads(key)]
    assert not unread, f"{name}: app.py does not read {unread}"
    assert not set(variant.secrets) & set(variant.variables), "a secret must not be committed as a variable"
    assert variant.front_matter.get("suggested_hardware", variant.hardware) == variant.hardware


@pytest.mark.parametrize("name", VARIANTS)
def test_variant_values_are_accepted(name):
    from engine.model.loading import DEVICE_CHOICES, DTYPE_CHOICES

    variables = deploy.load_variant(name).variables
    assert variables.get("DTYPE", "auto") in DTYPE_CHOICES
    assert variables.get("DEVICE", "auto") in DEVICE_CHOICES
    for key in ("MAX_NUM_SEQS", "MAX_QUEUE", "MAX_NUM_BATCHED_TOKENS", "MAX_MODEL_LEN", "MAX_NEW_TOKENS"):
        if key in variables:
            assert int(variables[key]) > 0
    if "KV_CACHE_MEMORY" in variables:
        assert re.fullmatch(r"\d+(\.\d+)?\s*[KMGT]iB", variables["KV_CACHE_MEMORY"])
    if "MODEL_ID" in variables:
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", variables["MODEL_ID"])


def test_there_is_a_cpu_and_a_gpu_variant():
    hardware = {deploy.load_variant(name).hardware for name in VARIANTS}
    assert "cpu-basic" in hardware
    assert hardware - {"cpu-basic", "cpu-upgrade"}


@pytest.mark.parametrize("name", VARIANTS)
def test_app_settings_accept_the_variant(name):
    """app.py's own settings parser takes the variant's variables as a Space passes them."""
    import app

    variables = deploy.load_variant(name).variables
    settings = app.parse_settings([], environ=dict(variables, GRADIO_SERVER_NAME="0.0.0.0", GRADIO_SERVER_PORT="7860"))
    assert (settings.host, settings.port) == ("0.0.0.0", 7860)
    assert settings.model_id == (variables.get("MODEL_ID") or None)
    assert settings.dtype == variables.get("DTYPE", "auto")
    assert settings.device == variables.get("DEVICE", "auto")
    if "MAX_NUM_SEQS" in variables:
        assert settings.max_num_seqs == int(variables["MAX_NUM_SEQS"])
    if "KV_CACHE_MEMORY" in variables:
        assert settings.kv_cache_memory is not None


def test_deploy_plan_sets_hardware_variables_and_secrets_from_the_environment():
    variant = deploy.load_variant("t4-small")
    steps = deploy.plan(variant, "someone/rill-gpu", environ={"API_KEY": "s3cret"})
    methods = [method for method, _ in steps]
    assert methods[:3] == ["create_repo", "upload_folder", "upload_file"]
    assert methods[-1] == "request_space_hardware" and steps[-1][1]["hardware"] == "t4-small"
    variables = {kw["key"]: kw["value"] for method, kw in steps if method == "add_space_variable"}
    assert variables == variant.variables
    secrets = [kw for method, kw in steps if method == "add_space_secret"]
    assert secrets == [{"repo_id": "someone/rill-gpu", "key": "API_KEY", "value": "s3cret"}]
    assert "s3cret" not in deploy.describe("add_space_secret", secrets[0])
    # without the secret in the environment it is not set (and never set to an empty value)
    assert "add_space_secret" not in [m for m, _ in deploy.plan(variant, "someone/rill-gpu", environ={})]
    # the uploaded README carries the variant's header and the rest of README.md unchanged
    readme = dict(steps)["upload_file"]["path_or_fileobj"].decode()
    header, body = deploy.split_front_matter(readme)
    original_header, original_body = deploy.split_front_matter((ROOT / "README.md").read_text())
    assert header == {**original_header, "suggested_hardware": "t4-small"}
    assert body == original_body
    upload = dict(steps)["upload_folder"]
    assert ".venv/*" in upload["ignore_patterns"] and "*.gguf" in upload["ignore_patterns"]


def test_deploy_dry_run_prints_the_plan_without_a_token():
    proc = subprocess.run([sys.executable, "spaces_config/deploy.py", "cpu-basic", "--space", "someone/rill",
                           "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(ROOT / ".no-home")})
    assert proc.returncode == 0, proc.stderr
    assert "create_repo(repo_id='someone/rill', repo_type='space', space_sdk='gradio'" in proc.stdout
    assert "request_space_hardware(repo_id='someone/rill', hardware='cpu-basic')" in proc.stdout
    assert "note: API_KEY is not set here" in proc.stdout


def test_deploy_rejects_an_unknown_variant():
    proc = subprocess.run([sys.executable, "spaces_config/deploy.py", "a100-huge", "--space", "x/y", "--dry-run"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "invalid choice: 'a100-huge'" in proc.stderr and "cpu-basic" in proc.stderr
