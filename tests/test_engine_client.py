"""Every backend honours the engine-client contract (frontend.backends.EngineClient), the one
surface server/, ui/ and frontend/ use of an engine: each declared member exists on the backend,
a method with a signature that the front end's calls fit, a property or attribute as declared."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from frontend.backends import EngineClient
from frontend.backends.local import LocalEngine
from frontend.backends.openai_backend import OpenAIEngine
from frontend.backends.remote import RemoteEngine
from frontend.models import ModelView


def _ray_engine():
    pytest.importorskip("ray.serve", reason="--backend ray needs requirements-ray.txt")
    from frontend.backends.ray_backend import RayEngine

    return RayEngine


MISSING = object()
BACKENDS = {"local": lambda: LocalEngine, "openai": lambda: OpenAIEngine, "ray": _ray_engine,
            "remote (what ray and openai share)": lambda: RemoteEngine,
            "a model of several (frontend/models.py's view of its current engine)": lambda: ModelView}


def declared() -> tuple[set[str], dict[str, object]]:
    """The protocol's data members, and its methods and properties by name."""
    data = set(EngineClient.__annotations__)
    members = {name: value for name, value in vars(EngineClient).items()
               if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property))}
    return data, members


def instance_attributes(cls) -> set[str]:
    """Names a method of `cls` or its bases assigns as `self.<name>` (what __init__ sets)."""
    names = set()
    for klass in cls.__mro__:
        if klass is object:
            continue
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(klass)))):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            for target in targets:
                for part in ast.walk(target):
                    if isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) and part.value.id == "self":
                        names.add(part.attr)
    return names


def signature_mismatch(name: str, want, have) -> str | None:
    """Why a call written against the declared method `want` would not fit `have`, or None."""
    if inspect.iscoroutinefunction(want) != inspect.iscoroutinefunction(have):
        return f"{name}: declared {'async' if inspect.iscoroutinefunction(want) else 'sync'}, implemented otherwise"
    wanted = list(inspect.signature(want).parameters.values())[1:]  # without self
    given = list(inspect.signature(have).parameters.values())[1:]
    by_name = {p.name: p for p in given}
    var_keyword = any(p.kind is p.VAR_KEYWORD for p in given)
    for index, param in enumerate(wanted):
        if param.kind is param.VAR_KEYWORD:
            if not var_keyword:
                return f"{name}: takes no **{param.name}"
            continue
        other = by_name.get(param.name)
        if other is None:
            return f"{name}: has no parameter {param.name!r}"
        if param.kind is param.POSITIONAL_OR_KEYWORD and (index >= len(given) or given[index] is not other
                                                           or other.kind is not other.POSITIONAL_OR_KEYWORD):
            return f"{name}: {param.name!r} is not positional parameter {index + 1}"
        if param.default is not param.empty and other.default != param.default:
            return f"{name}: {param.name!r} defaults to {other.default!r}, declared {param.default!r}"
    for other in given:  # what the front end does not pass must have a default
        if other.name not in {p.name for p in wanted} and other.kind in (other.POSITIONAL_OR_KEYWORD,
                                                                        other.KEYWORD_ONLY) \
                and other.default is other.empty:
            return f"{name}: needs {other.name!r}, which the contract does not pass"
    return None


def contract_problems(cls) -> list[str]:
    """What `cls` lacks or gets wrong of the contract (empty: it honours it)."""
    data, members = declared()
    assigned = instance_attributes(cls)
    problems = [f"{name}: missing" for name in sorted(data) if not hasattr(cls, name) and name not in assigned]
    for name, want in sorted(members.items()):
        have = inspect.getattr_static(cls, name, MISSING)
        if isinstance(want, property):
            if have is MISSING and name not in assigned:
                problems.append(f"{name}: missing (a property or attribute)")
            elif inspect.isfunction(have):
                problems.append(f"{name}: a method, declared a property")
        elif not inspect.isfunction(have):
            problems.append(f"{name}: missing (a method)")
        elif (why := signature_mismatch(name, want, have)) is not None:
            problems.append(why)
    return problems


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_each_backend_implements_every_member_the_contract_declares(backend):
    assert contract_problems(BACKENDS[backend]()) == []


def test_the_contract_check_names_a_member_removed_or_changed(monkeypatch):
    monkeypatch.delattr(RemoteEngine, "abort")
    monkeypatch.delattr(RemoteEngine, "think_tags")
    monkeypatch.setattr(LocalEngine, "add_request", lambda self, prompt_token_ids, params, request_id=None: None)
    monkeypatch.setattr(LocalEngine, "wait_admitted", lambda self, stream, timeout=None: None)
    assert contract_problems(OpenAIEngine) == ["think_tags: missing", "abort: missing (a method)"]
    assert contract_problems(LocalEngine) == ["add_request: has no parameter 'prior_output_ids'",
                                              "wait_admitted: declared async, implemented otherwise"]


def test_a_running_local_engine_is_an_engine_client(tiny_model):
    from engine.model.loading import load_model

    engine = LocalEngine(load_model(tiny_model("llama")))  # not started: its members are all there already
    try:
        assert isinstance(engine, EngineClient)
        assert engine.kv_cache_tokens == engine.core.num_kv_blocks * engine.config.block_size > 0
        assert engine.generation_config is engine.loaded.model.generation_config
        assert engine.grammars is not None and engine.backend == "local"
    finally:
        engine.shutdown()


def test_an_openai_engine_is_an_engine_client_without_a_model_here():
    engine = OpenAIEngine("http://127.0.0.1:9", None, "remote-model", 64, tokenizer=None, name="remote-model")
    try:
        assert isinstance(engine, EngineClient)
        assert (engine.generation_config, engine.kv_cache_tokens, engine.grammars, engine.think_tags) == (
            None, None, None, None)
    finally:
        engine.shutdown()
