"""Each route's default sampling comes from the model: its generation config where it has one (as
vLLM does for unset fields), the model card's settings for the embedded SmolLM2-135M-Instruct, and
the route's own fallback (OpenAI's 1.0, /chat's 0.7) only where the model says nothing."""

from __future__ import annotations

import json
from types import SimpleNamespace

from transformers import GenerationConfig

from frontend.sampling_defaults import SamplingDefaults, model_sampling_defaults, with_model_defaults
from server.chat import _sampling_params
from server.chat_path import sampling_params as _params
from server.schemas import ChatBody, ChatCompletionRequest
from ui.chat import ChatSettings


def _engine(name="some-model", generation_config=None, folder=None):
    return SimpleNamespace(model_name=name, generation_config=generation_config,
                           tokenizer=SimpleNamespace(name_or_path=folder))


def test_the_generation_config_gives_the_defaults():
    config = GenerationConfig(temperature=0.3, top_p=0.8, top_k=20, repetition_penalty=1.05)
    assert model_sampling_defaults(_engine(generation_config=config)) == SamplingDefaults(0.3, 0.8, 20, 1.05)
    assert model_sampling_defaults(_engine(generation_config=GenerationConfig())) == SamplingDefaults()


def test_a_remote_backend_reads_generation_config_json_beside_its_tokenizer(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 0}))
    engine = SimpleNamespace(model_name="m", generation_config=None, tokenizer=SimpleNamespace(name_or_path=str(tmp_path)))
    assert model_sampling_defaults(engine) == SamplingDefaults(temperature=0.6, top_p=0.95, top_k=0)


def test_the_embedded_model_gets_its_model_cards_settings():
    defaults = model_sampling_defaults(_engine("SmolLM2-135M-Instruct", GenerationConfig()))
    assert (defaults.temperature, defaults.top_p) == (0.2, 0.9)
    page = with_model_defaults(ChatSettings(), defaults)  # what the page's sliders show
    assert (page.temperature, page.top_p, page.top_k) == (0.2, 0.9, ChatSettings().top_k)


def test_routes_fill_unset_fields_from_the_model_and_keep_what_a_request_sets():
    model = SamplingDefaults(temperature=0.3, top_p=0.8, top_k=20, repetition_penalty=1.05)
    settings = SimpleNamespace(default_max_new_tokens=16)
    unset = _params(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]), 8, None, defaults=model)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.repetition_penalty) == (0.3, 0.8, 20, 1.05)
    given = _params(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=0, top_p=1,
                                          repetition_penalty=1), 8, None, defaults=model)
    assert (given.temperature, given.top_p, given.repetition_penalty) == (0, 1, 1)
    plain = _params(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]), 8, None)
    assert (plain.temperature, plain.top_p, plain.top_k, plain.repetition_penalty) == (1.0, 1.0, 0, 1.0)
    chat = _sampling_params(ChatBody(prompt="hi"), settings, SimpleNamespace(think_tags=None), model)
    assert (chat.temperature, chat.top_p, chat.top_k, chat.repetition_penalty) == (0.3, 0.8, 20, 1.05)
    seed_protocol = _sampling_params(ChatBody(prompt="hi"), settings, SimpleNamespace(think_tags=None))
    assert (seed_protocol.temperature, seed_protocol.top_p, seed_protocol.top_k) == (0.7, 1.0, 0)
