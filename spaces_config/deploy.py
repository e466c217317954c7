"""Deploy this checkout as a Hugging Face Space with one of the variants in spaces_config/.

    python spaces_config/deploy.py cpu-basic --space you/rill --dry-run   # print the plan
    HF_TOKEN=hf_... API_KEY=... python spaces_config/deploy.py t4-small --space you/rill-gpu

Steps: create the Space (Gradio SDK) if it does not exist, upload the code (no .venv, caches or
weights), with README.md's YAML header updated by the variant's `front_matter`, set the variant's
variables, set its secrets from this shell's environment (skipped with a note when unset), and
ask for its hardware (anything but cpu-basic needs billing on the account).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
IGNORE = [".git/*", ".venv/*", "**/__pycache__/*", "*.pyc", ".pytest_cache/*", ".hypothesis/*",
          "bench/results/*", "*.safetensors", "*.gguf", "*.bin"]


@dataclass(slots=True)
class Variant:
    """One deployable configuration: the hardware, README header keys, Space variables and secrets."""

    name: str  # the file's stem, e.g. "t4-small"
    hardware: str  # a huggingface_hub SpaceHardware value
    front_matter: dict = field(default_factory=dict)
    variables: dict[str, str] = field(default_factory=dict)
    secrets: list[str] = field(default_factory=list)


def variant_names() -> list[str]:
    return sorted(p.stem for p in HERE.glob("*.yaml"))


def load_variant(name: str) -> Variant:
    path = HERE / f"{name}.yaml"
    if not path.is_file():
        raise SystemExit(f"deploy.py: error: no variant {name!r}; choose one of {', '.join(variant_names())}")
    data = yaml.safe_load(path.read_text()) or {}
    return Variant(name=name, hardware=data["hardware"], front_matter=dict(data.get("front_matter") or {}),
                   variables={k: "" if v is None else str(v) for k, v in (data.get("variables") or {}).items()},
                   secrets=list(data.get("secrets") or []))


def split_front_matter(text: str) -> tuple[dict, str]:
    """README.md -> (its YAML header as a dict, the rest of the text)."""
    if not text.startswith("---\n"):
        raise ValueError("README.md must start with a '---' line (the Space's YAML header)")
    header, sep, body = text[4:].partition("\n---\n")
    if not sep:
        raise ValueError("README.md's YAML header has no closing '---' line")
    return yaml.safe_load(header) or {}, body


def render_readme(variant: Variant, readme: str | None = None) -> str:
    """README.md with the variant's `front_matter` keys set in its YAML header."""
    readme = (ROOT / "README.md").read_text() if readme is None else readme
    header, body = split_front_matter(readme)
    header.update(variant.front_matter)
    return "---\n" + yaml.safe_dump(header, sort_keys=False, allow_unicode=True) + "---\n" + body


def plan(variant: Variant, space: str, private: bool = False, environ=os.environ) -> list[tuple[str, dict]]:
    """The HfApi calls that deploy `variant` to `space`, in order, as (method, keyword arguments)."""
    steps = [("create_repo", dict(repo_id=space, repo_type="space", space_sdk="gradio", private=private,
                                  exist_ok=True)),
             ("upload_folder", dict(repo_id=space, repo_type="space", folder_path=str(ROOT),
                                    ignore_patterns=IGNORE + ["README.md"],
                                    commit_message=f"Deploy rill ({variant.name})")),
             ("upload_file", dict(repo_id=space, repo_type="space", path_in_repo="README.md",
                                  path_or_fileobj=render_readme(variant).encode(),
                                  commit_message=f"README header for {variant.name}"))]
    for key, value in variant.variables.items():
        steps.append(("add_space_variable", dict(repo_id=space, key=key, value=value)))
    for key in variant.secrets:
        if environ.get(key):
            steps.append(("add_space_secret", dict(repo_id=space, key=key, value=environ[key])))
    steps.append(("request_space_hardware", dict(repo_id=space, hardware=variant.hardware)))
    return steps


def describe(method: str, kwargs: dict) -> str:
    shown = {k: ("***" if method == "add_space_secret" and k == "value" else
                 f"<{len(v)} bytes>" if isinstance(v, bytes) else v) for k, v in kwargs.items()}
    return f"{method}({', '.join(f'{k}={v!r}' for k, v in shown.items())})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spaces_config/deploy.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("variant", choices=variant_names(), help="a spaces_config/<variant>.yaml")
    parser.add_argument("--space", required=True, help="owner/name of the Space (created if missing)")
    parser.add_argument("--private", action="store_true", help="create the Space private")
    parser.add_argument("--dry-run", action="store_true", help="print the calls, change nothing")
    args = parser.parse_args(argv)
    variant = load_variant(args.variant)
    steps = plan(variant, args.space, args.private)
    for key in variant.secrets:
        if not os.environ.get(key):
            print(f"note: {key} is not set here; set the secret later in the Space's Settings if you want it")
    if args.dry_run:
        for method, kwargs in steps:
            print(describe(method, kwargs))
        return 0
    from huggingface_hub import HfApi

    api = HfApi()
    for method, kwargs in steps:
        print(describe(method, kwargs), flush=True)
        getattr(api, method)(**kwargs)
    print(f"deployed: https://huggingface.co/spaces/{args.space}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
