"""Top-level pytest configuration: the fixture modules every test may use."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

pytest_plugins = ["tests.tiny_models", "tests.tiny_vision", "tests.servers"]


@pytest.fixture(scope="session")
def portable_cache(tmp_path_factory) -> Path:
    """A cache folder of the session's own for the portable build (`portable_kernels`): the kernels are
    compiled for -march=x86-64 once per run (over a minute on 2 cores), into a folder no earlier run filled,
    and every test of the portable paths loads that library."""
    return tmp_path_factory.mktemp("rill-portable-cache")


@pytest.fixture
def portable_kernels(monkeypatch):
    """engine.kernels, its C kernels built from then on as for a CPU without AVX2 (`-march=x86-64`: GCC's
    generic vectors) instead of for this one; `portable_cache` gets (or has) the portable build."""
    import engine.kernels as cpu

    monkeypatch.setenv("RILL_KERNEL_MARCH", "x86-64")
    return cpu


@pytest.fixture(scope="session")
def seed_kernels():
    """`seed_kernels(folder)`: `folder` becomes a cache holding this machine's kernels build (a link to the one
    in $RILL_CACHE, built there once if it is not), so a test that loads a model into a cache of its own
    finds the library its build would write (the same name: sources, compiler, CPU and flags) instead of
    compiling the kernels again (minutes on 2 cores). Returns `folder`."""
    import shutil

    from engine.config import rill_cache_dir
    from engine.kernels.build import compiled_library

    def seed(folder: Path) -> Path:
        _, built = compiled_library(rill_cache_dir())
        (folder / "kernels").mkdir(parents=True, exist_ok=True)
        try:
            os.link(built, folder / "kernels" / built.name)
        except OSError:  # another file system
            shutil.copy2(built, folder / "kernels" / built.name)
        return folder

    return seed
