"""One set of sampling defaults for every entrance: the model's generation config where it has one
(as vLLM does for unset fields), and rill's own (`RILL_SAMPLING`, greedy) only where the model says
nothing (the embedded SmolLM2-135M-Instruct GGUF)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from transformers import GenerationConfig

from frontend.images import ImageLimits
from frontend.request import ChatJob, RequestDefaults, Sampling, sampling_params
from frontend.sampling_defaults import RILL_SAMPLING, SamplingDefaults, model_sampling_defaults
from server.chat import _job as chat_job
from server.openai_api import sampling_of
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


def test_a_model_without_sampling_settings_gets_rills_on_every_entrance_and_the_page():
    defaults = model_sampling_defaults(_engine("SmolLM2-135M-Instruct", GenerationConfig()))  # the embedded GGUF
    assert defaults == SamplingDefaults()
    page = RequestDefaults(defaults).resolved()  # what the page's sliders show, and what an unset field takes
    assert page == RILL_SAMPLING


def test_every_entrance_fills_unset_fields_from_the_model_then_rill_and_keeps_what_a_request_sets():
    model = RequestDefaults(SamplingDefaults(temperature=0.3, top_p=0.8, top_k=20, repetition_penalty=1.05))
    hi = [{"role": "user", "content": "hi"}]
    jobs = {"/v1": ChatJob(hi, sampling=sampling_of(ChatCompletionRequest(messages=hi))),
            "/chat": chat_job(ChatBody(prompt="hi"), ImageLimits()),
            "page": ChatSettings().job([], "hi")}
    for entrance, job in jobs.items():
        unset = sampling_params(job, 8, model)
        assert (unset.temperature, unset.top_p, unset.top_k, unset.repetition_penalty) == (0.3, 0.8, 20, 1.05), entrance
        plain = sampling_params(job, 8, RequestDefaults())
        assert {name: getattr(plain, name) for name in RILL_SAMPLING} == RILL_SAMPLING, entrance
    given = ChatCompletionRequest(messages=hi, temperature=0, top_p=1, repetition_penalty=1)
    given = sampling_params(ChatJob(hi, sampling=sampling_of(given)), 8, model)
    assert (given.temperature, given.top_p, given.repetition_penalty) == (0, 1, 1)
    page = sampling_params(ChatSettings(temperature=0.0, top_k=5.0).job([], "hi"), 8, model)
    assert (page.temperature, page.top_k, page.top_p) == (0.0, 5, 0.8)
    assert sampling_params(ChatJob(hi, sampling=Sampling(min_p=0.2)), 8, model).min_p == 0.2
