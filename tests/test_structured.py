"""Constrained decoding and thinking in the engine (tiny random models, no server): what a user of
`LLM` / `SamplingParams` sees: text that matches, finish reasons, logprobs, the thought apart."""

from __future__ import annotations

import json
import time

import jsonschema
import numpy as np
import pytest
import torch

from engine import LLM, InvalidRequest, SamplingParams
from engine.grammar import GrammarCompiler, allowed_tokens, closed_objects
from engine.model.loading import load_model
from engine.request import Constraint, FinishReason, QueueFull
from tests.tiny_models import QWEN3_VOCAB, THINK_TOKENS, TINY_VOCAB

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
}, "required": ["name", "age", "role", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llama(tiny_model):
    return LLM(load_model(tiny_model("llama")))


@pytest.fixture(scope="module")
def qwen3(tiny_model):
    return LLM(load_model(tiny_model("qwen3")))


def _one(llm, prompt, **params):
    return llm.generate([prompt], SamplingParams(**params))[0]


def _replays(llm, constraint: Constraint, token_ids: list[int]) -> bool:
    """Whether a fresh matcher of `constraint` accepts every token (the EOS one included)."""
    matcher = llm.core.grammars.matcher(constraint)
    return all(matcher.consume_token(t) for t in token_ids)


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_json_schema_output_validates_and_ends_with_stop(llama, temperature):
    constraint = Constraint.json_schema(PERSON, strict=True)
    for seed in (range(2) if temperature else [0]):  # greedy: one run says it all
        result = _one(llama, "Describe a person:", max_tokens=200, temperature=temperature, seed=seed,
                      constraint=constraint)
        assert result.finish_reason is FinishReason.STOP, result.text
        jsonschema.validate(json.loads(result.text), PERSON)
        assert _replays(llama, constraint, result.token_ids)


def test_regex_json_object_and_lark_grammar(llama):
    regex = _one(llama, "Code:", max_tokens=30, temperature=1.0, seed=3,
                 constraint=Constraint("regex", r"[0-9]{3}-[a-z]{2}"))
    assert regex.finish_reason is FinishReason.STOP
    assert len(regex.text) == 6 and regex.text[:3].isdigit() and regex.text[3] == "-" and regex.text[4:].isalpha()
    obj = _one(llama, "JSON:", max_tokens=60, temperature=0.7, seed=1, constraint=Constraint("json_object"))
    if obj.finish_reason is FinishReason.STOP:
        assert isinstance(json.loads(obj.text), dict)
    else:  # cut: still a prefix of an object
        assert obj.text.startswith("{")
    lark = _one(llama, "Answer:", max_tokens=30, temperature=1.0, seed=2,
                constraint=Constraint("grammar", 'start: "yes" | "no" | "maybe " /[a-c]{2}/'))
    assert lark.finish_reason is FinishReason.STOP
    assert lark.text in ("yes", "no") or (lark.text.startswith("maybe ") and len(lark.text) == 8)


def test_strict_closes_objects_only_where_the_schema_is_silent():
    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"a": {}}},
                                               "open": {"type": "object", "properties": {},
                                                        "additionalProperties": True}},
              "$defs": {"x": {"properties": {"b": {}}}}, "anyOf": [{"properties": {}}]}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is False  # a property named "properties"
    assert "additionalProperties" not in closed["properties"]  # ...is a name, not a keyword
    assert closed["properties"]["open"]["additionalProperties"] is True
    assert closed["$defs"]["x"]["additionalProperties"] is False and closed["anyOf"][0]["additionalProperties"] is False


def test_cut_by_max_tokens_is_length(llama):
    result = _one(llama, "List:", max_tokens=4, temperature=0,
                  constraint=Constraint.json_schema({"type": "array", "items": {"type": "integer"}, "minItems": 50}))
    assert result.finish_reason is FinishReason.LENGTH
    assert len(result.token_ids) == 4 and result.text.startswith("[")


def test_stop_string_inside_the_constrained_answer_stops_there(llama):
    result = _one(llama, "Code:", max_tokens=30, temperature=0, constraint=Constraint("regex", "abc-[0-9]{5}"),
                  stop=["-"])
    assert result.finish_reason is FinishReason.STOP
    assert result.text == "abc"


def test_unconstrained_rows_are_untouched_and_seeded_rows_repeat(llama):
    prompts = ["Hello there", "Once upon a time"]
    plain = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
             SamplingParams(max_tokens=24, temperature=0.9, seed=7, ignore_eos=True)]
    alone = [_one(llama, p, **_fields(q)).token_ids for p in prompts for q in plain]
    constrained = SamplingParams(max_tokens=40, temperature=0.9, seed=11, constraint=Constraint.json_schema(PERSON))
    mixed = llama.generate(prompts * 2 + ["Person:"] * 3,
                           [q for q in plain for _ in prompts] + [constrained] * 3)
    together = {(r.prompt_token_ids[0], i // len(prompts)): r.token_ids for i, r in enumerate(mixed[:4])}
    assert [together[(llama.tokenizer.encode(p)[0], k)] for p in prompts for k in range(2)] == alone
    seeded = [r.token_ids for r in mixed[4:]]
    assert seeded[0] == seeded[1] == seeded[2] == _one(llama, "Person:", **_fields(constrained)).token_ids


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in SamplingParams.__dataclass_fields__}


def test_logprobs_under_a_mask_cover_allowed_tokens_only(llama):
    constraint = Constraint("regex", "(yes|no|maybe)")
    result = _one(llama, "Answer:", max_tokens=10, temperature=0, constraint=constraint, logprobs=20)
    first = result.outputs[0].logprobs[0]
    matcher = llama.core.grammars.matcher(constraint)
    allowed = allowed_tokens(llama.core.grammars.fill_bitmasks([matcher]), llama.core.logits_width)[0]
    assert np.isfinite(first.logprob) and first.logprob <= 0
    assert first.top and all(allowed[t] for t, _ in first.top)
    assert len(first.top) == min(20, int(allowed.sum()))
    assert abs(sum(np.exp(v) for _, v in first.top) - 1) < 1e-4 or len(first.top) == 20
    assert first.top[0][0] == first.token_id  # greedy picked the most likely allowed token


def test_padded_vocabulary_ids_are_masked(qwen3):
    """qwen3's logits have 1088 entries, its tokenizer 1028 tokens: the mask covers the whole row."""
    grammars = qwen3.core.grammars
    assert qwen3.core.logits_width == QWEN3_VOCAB and len(qwen3.tokenizer) == TINY_VOCAB + len(THINK_TOKENS)
    matcher = grammars.matcher(Constraint("regex", "[a-z ]+"))
    allowed = allowed_tokens(grammars.fill_bitmasks([matcher]), QWEN3_VOCAB)[0]
    assert allowed.shape == (QWEN3_VOCAB,) and not allowed[len(qwen3.tokenizer):].any() and allowed.any()
    for seed in range(3):  # a hot temperature samples the padding ids when nothing masks them
        out = _one(qwen3, "Hello", max_tokens=40, temperature=5.0, seed=seed,
                   constraint=Constraint("regex", "[a-z ]{1,30}"))
        assert max(out.token_ids) < len(qwen3.tokenizer)
        assert all(ch.islower() or ch == " " for ch in out.text)


def test_bad_constraints_are_refused_with_the_reason(llama):
    compile_ = llama.core.grammars.compile
    with pytest.raises(InvalidRequest, match="(?s)regex cannot be used.*unclosed character class") as info:
        compile_(Constraint("regex", "[a-"))
    assert info.value.param == "regex"
    with pytest.raises(InvalidRequest, match="Unimplemented keys"):
        compile_(Constraint.json_schema({"type": "object", "not": {"type": "string"}}, strict=True))
    compile_(Constraint.json_schema({"type": "object", "not": {"type": "string"}}, strict=False))  # lenient
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        Constraint("json_schema", "{oops")
    with pytest.raises(InvalidRequest, match="Lark grammar cannot be used"):
        compile_(Constraint("grammar", "start: undefined_rule"))
    with pytest.raises(InvalidRequest, match="`constraint` must be null or a Constraint"):
        SamplingParams(constraint={"type": "json_object"})
    with pytest.raises(InvalidRequest, match="`max_reasoning_tokens` must be null or an integer between 0 and"):
        SamplingParams(max_tokens=8, max_reasoning_tokens=9)


def test_hostile_schemas_fail_fast_and_failures_are_cached(llama):
    depth = 200  # within Python's recursion limit, past llguidance's
    deep = '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + '}, "required": ["a"]}' * depth
    constraint = Constraint("json_schema", deep)
    with pytest.raises(InvalidRequest, match="JSON schema cannot be used.*recursion limit"):
        llama.core.grammars.compile(constraint)
    assert isinstance(llama.core.grammars._cache[constraint], str)  # the next one is answered from the cache
    with pytest.raises(InvalidRequest, match="nested too deeply"):
        Constraint("json_schema", "[" * 5000 + "]" * 5000)
    huge_enum = json.dumps({"enum": [f"value-{i}-{'x' * 6}" for i in range(12_000)]})
    with pytest.raises(InvalidRequest, match="JSON schema is too long: at most 200000 characters"):
        Constraint("json_schema", huge_enum)


def test_a_compile_past_the_timeout_is_refused(tiny_model, monkeypatch):
    loaded = load_model(tiny_model("llama"))
    compiler = GrammarCompiler(loaded.tokenizer, TINY_VOCAB, [2], timeout_s=0.2)
    real_build = compiler._build

    def slow_build(constraint):
        time.sleep(1.0)
        return real_build(constraint)

    monkeypatch.setattr(compiler, "_build", slow_build)
    with pytest.raises(InvalidRequest, match=r"did not compile within 0.2 s"):
        compiler.compile(Constraint("regex", "a+"))
    compiler.submit(Constraint("regex", "a+")).result(5)  # it finishes in the background, then is cached
    compiler.compile(Constraint("regex", "a+"))
    monkeypatch.setattr("engine.grammar.MAX_PENDING_COMPILES", 1)
    compiler.submit(Constraint("regex", "b+"))
    compiler.submit(Constraint("regex", "b+"))  # the same constraint shares the compile in progress
    with pytest.raises(QueueFull, match="Too many grammars are compiling"):
        compiler.submit(Constraint("regex", "c+"))


def test_a_compile_done_before_it_is_awaited_does_not_lock_the_compiler(tiny_model):
    """A compile can end before `submit` attaches its callback (a fast one, a busy machine): that
    callback then runs at once in the submitting thread. Forced here with a pool that compiles
    synchronously; the compiler must answer, and go on answering, instead of waiting on itself
    (it once did, and with it the engine thread and every constrained request)."""
    import concurrent.futures
    import threading

    loaded = load_model(tiny_model("llama"))
    compiler = GrammarCompiler(loaded.tokenizer, TINY_VOCAB, [2])

    class AtOnce(concurrent.futures.Executor):
        def submit(self, function, *args):
            future = concurrent.futures.Future()
            future.set_result(function(*args))
            return future

    compiler._pool = AtOnce()
    answers = []

    def use():  # in a daemon thread: a compiler waiting on itself must fail the test, not hang it
        compiler.compile(Constraint("regex", "a+"))
        answers.append(compiler.matcher(Constraint("regex", "a+")))
        try:
            compiler.compile(Constraint("grammar", "start: ("))
        except InvalidRequest as exc:
            answers.append(str(exc))

    thread = threading.Thread(target=use, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the compiler waits on its own lock"
    matcher, refusal = answers
    assert not matcher.is_error() and "cannot be used for constrained output" in refusal
    assert not compiler._pending


def _thinking_prompt(llm, **kwargs) -> list[int]:
    """qwen3's chat prompt: the thought opened (by default) or written empty (enable_thinking=False)."""
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True, **kwargs)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def test_thought_is_split_from_the_answer_and_its_budget_forces_the_end(qwen3):
    end_id = qwen3.tokenizer.convert_tokens_to_ids("</think>")
    prompt = _thinking_prompt(qwen3)
    plain = _one(qwen3, prompt, max_tokens=30, temperature=0, ignore_eos=True)
    assert plain.outputs[0].reasoning == "" and end_id not in plain.token_ids[:30]  # not asked: one text
    result = _one(qwen3, prompt, max_tokens=30, temperature=0, ignore_eos=True, reasoning=True,
                  max_reasoning_tokens=6)
    assert result.token_ids[6] == end_id and result.token_ids[:6] == plain.token_ids[:6]
    out = result.outputs[0]
    assert out.reasoning == qwen3.tokenizer.decode(result.token_ids[:6])
    assert "</think>" not in out.text and out.text == qwen3.tokenizer.decode(result.token_ids[7:]).lstrip()


def test_grammar_applies_after_the_thought(qwen3):
    prompt = _thinking_prompt(qwen3)
    constraint = Constraint("regex", "(red|green|blue)")
    result = _one(qwen3, prompt, max_tokens=40, temperature=0.8, seed=5, reasoning=True, max_reasoning_tokens=8,
                  constraint=constraint)
    assert result.finish_reason is FinishReason.STOP
    assert result.text in ("red", "green", "blue")
    assert len(result.outputs[0].reasoning) > 0  # the thought was free text
    # with thinking switched off in the template, the answer is constrained from its first token
    closed = _thinking_prompt(qwen3, enable_thinking=False)
    direct = _one(qwen3, closed, max_tokens=40, temperature=0, reasoning=True, constraint=constraint)
    assert direct.text in ("red", "green", "blue") and direct.outputs[0].reasoning == ""


def test_grammar_lets_the_first_token_open_a_thought(qwen3):
    """Without an opened thought in the prompt, a thinking model may start with <think>: the grammar
    allows it (and nothing else outside the grammar)."""
    start_id = qwen3.tokenizer.convert_tokens_to_ids("<think>")
    prompt = qwen3.tokenizer.encode("Hello", add_special_tokens=False)  # no chat template: no thought opened
    seq_params = SamplingParams(max_tokens=8, temperature=0, reasoning=True, constraint=Constraint("regex", "zzz"))
    qwen3.core.add_request("probe", prompt, seq_params)
    seq = qwen3.core.by_request["probe"][0]
    try:
        bitmask = qwen3.core.grammars.fill_bitmasks([seq.grammar.matcher])
        allowed = set(np.flatnonzero(allowed_tokens(bitmask, QWEN3_VOCAB)[0]).tolist())
        assert start_id not in allowed  # the grammar alone...
        masked = qwen3.core.sampler._mask(torch.zeros(1, QWEN3_VOCAB), [seq], [0])  # [1, vocab]
        assert set(masked[0].isfinite().nonzero().flatten().tolist()) == allowed | {start_id}  # ...may open a thought
        qwen3.core._append_token(seq, start_id, None, 0.0)  # the model opens it
        assert seq.reasoning.thinking and not seq.grammar.active  # free text until </think>
        qwen3.core._append_token(seq, qwen3.tokenizer.convert_tokens_to_ids("</think>"), None, 0.0)
        assert seq.grammar.active and not seq.reasoning.may_open
    finally:
        qwen3.core.abort("probe")


def _stream(core, request_id, prompt, params, prior=()) -> tuple[list[int], list[str], list[str]]:
    core.add_request(request_id, prompt, params, prior_output_ids=list(prior))
    tokens, texts, thoughts = [], [], []
    while core.has_work():
        for out in core.step():
            tokens += out.token_ids
            texts.append(out.text)
            thoughts.append(out.reasoning)
    return tokens, texts, thoughts


def test_a_resumed_thinking_stream_continues_its_thought_and_answer_at_any_cut(qwen3):
    """A continuation replays the thought's end and the answer's dropped leading whitespace: what
    was shown before the cut plus what comes after is the uncut stream's thought and answer."""
    core = qwen3.core
    prompt = _thinking_prompt(qwen3)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, reasoning=True, max_reasoning_tokens=6)
    ids, texts, thoughts = _stream(core, "whole", prompt, params)
    assert ids[6] == qwen3.tokenizer.convert_tokens_to_ids("</think>") and "".join(texts)
    for cut in range(1, 20):
        tokens, more_texts, more_thoughts = _stream(core, f"cut-{cut}", prompt, params, ids[:cut])
        assert tokens == ids[cut:]
        assert "".join(thoughts[:cut] + more_thoughts) == "".join(thoughts), cut
        assert "".join(texts[:cut] + more_texts) == "".join(texts), cut
