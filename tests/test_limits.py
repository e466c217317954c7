"""One request must not be able to stall the others (no model, fast): the stop-string matcher
against a brute-force reference, `SamplingParams` refusing every out-of-range field with its
name, range and value, and the page's history bounds and linear trimming."""

from __future__ import annotations

import asyncio
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer, StopMatcher
from engine.request import MAX_STOP_LENGTH, InvalidRequest, SamplingParams, prompt_char_limit
from frontend.request import RequestDefaults, fit_to_context
from ui.chat import ChatSettings, stream_answer
from ui.history import MAX_HISTORY_CHARS, MAX_HISTORY_MESSAGES, ChatError, to_engine_messages

# --------------------------------------------------------------------------- stop strings


class PieceTokenizer:
    """Token id i decodes to `pieces[i]`; a sequence decodes to the pieces joined."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids)


def _first(text: str, stop: str) -> int | None:
    for start in range(len(text) - len(stop) + 1):
        if text[start:start + len(stop)] == stop:
            return start
    return None


def _held(text: str, stops) -> int:
    """The longest tail of `text` that is a proper prefix of a stop (brute force)."""
    return max((k for s in stops for k in range(len(s)) if k <= len(text) and text[len(text) - k:] == s[:k]),
               default=0)


def reference_deltas(pieces: list[str], stops) -> list[str]:
    """What a client must see when the text arrives in `pieces`: after each piece, the text up to
    the earliest stop string found so far (and nothing after it), else everything except a tail
    that could still begin a stop; at the end, all that was held back."""
    text, emitted, deltas = "", 0, []
    for piece in pieces:
        text += piece
        hits = [i for i in (_first(text, s) for s in stops) if i is not None]
        if hits:
            cut = min(hits)
            assert cut >= emitted, "a stop string was half-emitted by the reference"
            deltas.append(text[emitted:cut])
            return deltas
        end = max(emitted, len(text) - _held(text, stops))
        deltas.append(text[emitted:end])
        emitted = end
    deltas.append(text[emitted:])
    return deltas


def detokenizer_deltas(pieces: list[str], stops) -> list[str]:
    detok = IncrementalDetokenizer(PieceTokenizer(pieces), stop=tuple(stops), release_final_replacements=False)
    deltas = []
    for token_id in range(len(pieces)):
        deltas.append(detok.add(token_id))
        if detok.stopped:
            return deltas
    deltas.append(detok.flush())
    return deltas


alphabet = st.sampled_from("aab")  # a small alphabet: stops overlap and repeat often
stops_strategy = st.lists(st.text(alphabet, min_size=1, max_size=7), min_size=1, max_size=5)
pieces_strategy = st.lists(st.text(st.sampled_from("aabc"), max_size=5), max_size=25)


@settings(max_examples=600, deadline=None)
@given(stops=stops_strategy, pieces=pieces_strategy)
def test_stop_strings_stream_exactly_like_the_brute_force_reference(stops, pieces):
    assert detokenizer_deltas(pieces, stops) == reference_deltas(pieces, stops)


@settings(max_examples=300, deadline=None)
@given(stops=stops_strategy, text=st.text(st.sampled_from("aabc"), max_size=60))
def test_matcher_holds_back_exactly_the_longest_tail_that_begins_a_stop(stops, text):
    matcher = StopMatcher(tuple(stops))
    for end in range(1, len(text) + 1):
        hit = matcher.feed(text[:end], end - 1)
        first = [i for i in (_first(text[:end], s) for s in stops) if i is not None]
        if first:
            assert hit == min(first)
            return
        assert hit is None
        assert matcher.partial == _held(text[:end], stops)


def test_longest_allowed_stops_are_found_and_never_half_emitted():
    long_stops = tuple("ab" * 127 + chr(ord("c") + i) + "" for i in range(16))  # 255 characters each
    assert all(len(s) <= MAX_STOP_LENGTH for s in long_stops)
    pieces = ["ab"] * 400 + ["e", "tail"]  # the stop ending in "e" completes after 800 characters
    deltas = detokenizer_deltas(pieces, long_stops)
    assert "".join(deltas) == "ab" * (400 - 127)
    assert all(not d.endswith("a") for d in deltas[:-1])  # held back while "ab..." could begin a stop


def test_a_resumed_stream_primes_without_emitting_and_still_stops():
    pieces = ["Hel", "lo ", "wor", "ld", "!", " STO", "P", " more"]
    detok = IncrementalDetokenizer(PieceTokenizer(pieces), stop=("STOP",), release_final_replacements=False)
    detok.prime([0, 1, 2])
    assert [detok.add(i) for i in (3, 4, 5)] == ["ld", "!", " "]  # "STO" could begin the stop: held
    assert detok.add(6) == "" and detok.stopped
    assert detok.text == "Hello world! "


# --------------------------------------------------------------------------- SamplingParams

INF, NAN = math.inf, math.nan


@pytest.mark.parametrize("field, value, allowed", [
    ("max_tokens", 0, "an integer >= 1"),
    ("max_tokens", 2.0, "an integer >= 1"),
    ("max_tokens", True, "an integer >= 1"),
    ("min_tokens", -1, "an integer between 0 and max_tokens (16)"),
    ("min_tokens", 17, "an integer between 0 and max_tokens (16)"),
    ("temperature", INF, "a number in [0, 100] (0 = greedy)"),
    ("temperature", NAN, "a number in [0, 100] (0 = greedy)"),
    ("temperature", -0.5, "a number in [0, 100] (0 = greedy)"),
    ("temperature", 101, "a number in [0, 100] (0 = greedy)"),
    ("temperature", "0.5", "a number in [0, 100] (0 = greedy)"),
    ("top_p", 0, "in (0, 1]"),
    ("top_p", NAN, "in (0, 1]"),
    ("top_p", 1.5, "in (0, 1]"),
    ("top_k", -1, "an integer >= 0 (0 = off)"),
    ("top_k", INF, "an integer >= 0 (0 = off)"),
    ("min_p", NAN, "in [0, 1]"),
    ("min_p", -INF, "in [0, 1]"),
    ("repetition_penalty", INF, "a number in (0, 100] (1 = off)"),
    ("repetition_penalty", 0, "a number in (0, 100] (1 = off)"),
    ("repetition_penalty", NAN, "a number in (0, 100] (1 = off)"),
    ("presence_penalty", INF, "in [-2, 2]"),
    ("presence_penalty", -3, "in [-2, 2]"),
    ("frequency_penalty", NAN, "in [-2, 2]"),
    ("frequency_penalty", 2.5, "in [-2, 2]"),
    ("seed", 2**70, "null or an integer that fits in 64 bits (-2**63 to 2**63 - 1)"),
    ("seed", 2**63, "null or an integer that fits in 64 bits (-2**63 to 2**63 - 1)"),
    ("seed", -(2**63) - 1, "null or an integer that fits in 64 bits (-2**63 to 2**63 - 1)"),
    ("seed", 1.5, "null or an integer that fits in 64 bits (-2**63 to 2**63 - 1)"),
    ("stop", ("",), "at most 16 non-empty strings"),
    ("stop", ("x",) * 17, "at most 16 non-empty strings"),
    ("stop", (5,), "at most 16 non-empty strings"),
    ("stop", 5, "a string or a list of strings"),
    ("stop_token_ids", (-1,), "non-negative integer token ids"),
    ("stop_token_ids", (2**70,), "non-negative integer token ids"),
    ("stop_token_ids", 7, "a list of token ids"),
    ("ignore_eos", "yes", "true or false"),
    ("logprobs", 21, "null or an integer between 0 and 20"),
    ("logprobs", INF, "null or an integer between 0 and 20"),
    ("n", 0, "an integer between 1 and 16"),
    ("n", 17, "an integer between 1 and 16"),
    ("skip_special_tokens", None, "true or false"),
])
def test_every_sampling_field_is_checked_with_its_name_range_and_value(field, value, allowed):
    with pytest.raises(InvalidRequest) as caught:
        SamplingParams(**{field: value})
    given = list(value) if isinstance(value, tuple) else value
    assert str(caught.value) == f"`{field}` must be {allowed}. Given: {given!r}"
    assert caught.value.param == field


def test_an_overlong_stop_string_is_refused_with_the_limit_and_its_length():
    with pytest.raises(InvalidRequest) as caught:
        SamplingParams(stop=("ok", "x" * 300))
    message = str(caught.value)
    assert message.startswith("`stop` must be strings of at most 256 characters each (one is 300 characters). Given: 'xxx")
    assert len(message) < 400  # a 1 MB stop is not echoed back whole


def test_the_edges_of_every_range_are_accepted():
    params = SamplingParams(max_tokens=1, min_tokens=1, temperature=100, top_p=1, top_k=0, min_p=1,
                            repetition_penalty=100, presence_penalty=-2, frequency_penalty=2, seed=2**63 - 1,
                            stop=tuple(chr(65 + i) * MAX_STOP_LENGTH for i in range(16)), stop_token_ids=(0,),
                            ignore_eos=True, logprobs=20, n=16, skip_special_tokens=False)
    assert params.seed == 2**63 - 1 and len(params.stop) == 16
    assert SamplingParams(seed=-(2**63), temperature=0).greedy


# --------------------------------------------------------------------------- the page's history


class WordEngine:
    """encode_chat: one token per word plus one per message; counts its renders."""

    think_tags = None  # EngineClient's member: no reasoning model

    def __init__(self, max_model_len: int):
        self.max_model_len = max_model_len
        self.renders = 0

    def encode_chat(self, messages, add_generation_prompt=True):
        self.renders += 1
        return [0] * sum(1 + len(m["content"].split()) for m in messages)


def _conversation(words_per_message: list[int]) -> list[dict]:
    roles = ("user", "assistant")
    return [{"role": roles[i % 2], "content": " ".join(["w"] * n)} for i, n in enumerate(words_per_message)]


def _turns_of(history: list[dict]) -> list[list[dict]]:
    turns = []
    for m in history:
        if m["role"] == "user" or not turns:
            turns.append([m])
        else:
            turns[-1].append(m)
    return turns


def _fewest_dropped(engine, history, message, max_new_tokens):
    """The old algorithm: drop one turn at a time, render each time."""
    turns = _turns_of(history)
    for dropped in range(len(turns) + 1):
        kept = [m for turn in turns[dropped:] for m in turn]
        if len(engine.encode_chat(kept + [{"role": "user", "content": message}])) + max_new_tokens <= engine.max_model_len:
            return dropped
    return len(turns)


@settings(max_examples=300, deadline=None)
@given(words=st.lists(st.integers(0, 12), max_size=40), context=st.integers(8, 120), answer=st.integers(1, 6))
def test_trimming_drops_the_fewest_oldest_turns_like_one_at_a_time(words, context, answer):
    history = _conversation(words)
    engine = WordEngine(context)
    try:
        fitted = fit_to_context(engine, history + [{"role": "user", "content": "the question"}], answer)
    except InvalidRequest:
        assert len(engine.encode_chat([{"role": "user", "content": "the question"}])) >= context
        return
    expected = _fewest_dropped(WordEngine(context), history, "the question", answer)
    assert fitted.dropped_turns == expected
    kept = [m for turn in _turns_of(history)[expected:] for m in turn] + [{"role": "user", "content": "the question"}]
    assert fitted.prompt_token_ids == engine.encode_chat(kept)  # the kept turns and the message, nothing else
    assert len(fitted.prompt_token_ids) + fitted.max_tokens <= context


def test_a_long_history_costs_a_logarithmic_number_of_renders():
    history = _conversation([5] * 1000)  # 500 turns
    engine = WordEngine(200)
    fitted = fit_to_context(engine, [{"role": "system", "content": "be brief"}, *history,
                                     {"role": "user", "content": "now?"}], 50)
    assert fitted.dropped_turns == 500 - 12  # 12 turns of 12 tokens + system, message and answer fit
    assert engine.renders <= 2 + math.ceil(math.log2(501))
    kept = [m for turn in _turns_of(history)[500 - 12:] for m in turn]
    assert fitted.prompt_token_ids == WordEngine(200).encode_chat(
        [{"role": "system", "content": "be brief"}] + kept + [{"role": "user", "content": "now?"}])


def test_turns_beyond_the_character_bound_are_dropped_without_rendering_them():
    context = 50
    huge = "w " * (prompt_char_limit(context) // 2)  # one message alone is past the bound
    history = [{"role": "user", "content": huge}, {"role": "assistant", "content": "ok"},
               {"role": "user", "content": "short"}, {"role": "assistant", "content": "fine"}]
    engine = WordEngine(context)
    rendered = []
    engine.encode_chat = lambda messages, add_generation_prompt=True: rendered.append(messages) or [0] * 10
    fitted = fit_to_context(engine, history + [{"role": "user", "content": "next"}], 8)
    assert fitted.dropped_turns == 1
    assert all(m["content"] != huge for messages in rendered for m in messages)


def test_a_message_past_the_character_bound_is_refused_before_any_render():
    engine = WordEngine(10)
    with pytest.raises(InvalidRequest, match=r"has 161 characters, and the model's context of 10 tokens takes at "
                                             r"most 160 characters"):
        fit_to_context(engine, [{"role": "user", "content": "x" * 161}], 1)
    assert engine.renders == 0


@pytest.mark.parametrize("history, message", [
    ([{"role": "user", "content": "hi"}] * (MAX_HISTORY_MESSAGES + 1),
     f"at most {MAX_HISTORY_MESSAGES} messages are allowed. Given: {MAX_HISTORY_MESSAGES + 1} messages"),
    ([{"role": "user", "content": "x" * (MAX_HISTORY_CHARS // 2 + 1)}] * 2,
     f"at most {MAX_HISTORY_CHARS} characters are allowed in all its messages. Given: {MAX_HISTORY_CHARS + 2} characters"),
    ("not a list", "`history` must be a list of messages"),
    (5, "`history` must be a list of messages"),
])
def test_an_oversized_or_malformed_history_is_a_clear_error(history, message):
    with pytest.raises(ChatError) as caught:
        to_engine_messages(history, escaped=False)
    assert message in str(caught.value)


@pytest.mark.parametrize("settings_, message", [
    (ChatSettings(temperature=INF), "`temperature` must be a number in [0, 100] (0 = greedy). Given: inf"),
    (ChatSettings(repetition_penalty=NAN), "`repetition_penalty` must be a number in (0, 100] (1 = off). Given: nan"),
    (ChatSettings(top_k=INF), "`top_k` must be an integer >= 0 (0 = off). Given: inf"),
    (ChatSettings(max_new_tokens=INF), "`max_new_tokens` must be an integer >= 1. Given: inf"),
    (ChatSettings(top_p="lots"), "`top_p` must be in (0, 1]. Given: 'lots'"),
    (ChatSettings(temperature=[1]), "`temperature` must be a number in [0, 100] (0 = greedy). Given: [1]"),
    (ChatSettings(system_prompt=["a"]), "`system_prompt` must be a string. Given: list"),
])
def test_the_page_api_refuses_non_finite_and_wrong_typed_settings(settings_, message):
    engine = WordEngine(64)
    async def answer():
        async for _ in stream_answer(engine, RequestDefaults(), [], "hi", settings_, admission={}):
            pass

    with pytest.raises((ChatError, InvalidRequest)) as caught:
        asyncio.run(answer())
    assert message in str(caught.value)
    assert engine.renders == 0  # refused before any tokenizing
