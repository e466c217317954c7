"""Sampling features, detokenization, abort and fault isolation on a tiny random Llama."""

import asyncio
import random
import time

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

from engine import LLM, AsyncEngine, EngineConfig, FinishReason, RequestOutput, SamplingParams
from engine.attention import PagedKVCache
from engine.detokenizer import IncrementalDetokenizer, replacement_is_final
from engine.model.loading import load_model


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def llm(llama):
    return LLM(load_model(str(llama)))


def greedy(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(temperature=0, **{"max_tokens": 20, **kw}))[0]


def test_detokenizer_never_emits_broken_characters(llm):
    tok = llm.tokenizer
    text = "你好，世界！😀 法国的首都是巴黎。🚀👨‍👩‍👧‍👦 done"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) // 2  # multi-byte characters really span several tokens
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(t) for t in ids] + [detok.flush()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == text


def byte_fallback_tokenizer():
    """A SentencePiece-style tokenizer: a few word pieces, then <0x00>..<0xFF> byte tokens whose
    runs the ByteFallback decoder turns into text only when the whole run is valid UTF-8."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "\u2581the", "\u2581cat", "\u2581", "a", "b"] + [f"<0x{b:02X}>" for b in range(256)]
    backend = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>",
                                   byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", clean_up_tokenization_spaces=False)


def stream(tokenizer, ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer)
    return [detok.add(t) for t in ids] + [detok.flush()]


def test_stray_bytes_are_released_once_final(llm):
    """A random model may emit bytes that never form a character: they show as U+FFFD as soon as
    the next byte proves them final, instead of holding all later text back to the end."""
    tok = llm.tokenizer
    assert replacement_is_final(tok)
    byte = {b: tok.convert_tokens_to_ids(symbol) for b, symbol in bytes_to_unicode().items()}
    stray = byte[0x80]  # a lone continuation byte
    assert tok.decode([stray]) == "\ufffd"
    hi = tok.encode("Hi", add_special_tokens=False)
    ids = hi + [stray] * 12 + tok.encode(" there 你好😀", add_special_tokens=False)
    deltas = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == "Hi" + "\ufffd" * 12 + " there 你好😀"
    assert "".join(deltas[:len(hi) + 12]) == "Hi" + "\ufffd" * 11  # one byte behind, not all at the end

    rng = random.Random(7)  # random token soups, heavy in lone and partial UTF-8 bytes
    for _ in range(300):
        ids = [byte[rng.choice([0x80, 0xBF, 0xE4, 0xF0, 0x9F, 0x41, rng.randrange(256)])] if rng.random() < 0.7 else rng.randrange(len(tok)) for _ in range(rng.randint(1, 40))]
        assert "".join(stream(tok, ids)) == tok.decode(ids, skip_special_tokens=True), ids


def test_byte_fallback_runs_are_held_until_they_complete():
    tok = byte_fallback_tokenizer()
    assert not replacement_is_final(tok)
    byte = {b: tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)}
    # an emoji then the first two bytes of 中: the run decodes as six U+FFFD until its last byte comes
    ids = [tok.convert_tokens_to_ids("\u2581cat")] + [byte[b] for b in "😀中".encode()] + [tok.convert_tokens_to_ids("a")]
    deltas = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == " cat😀中a"
    assert all("\ufffd" not in d for d in deltas)
    rng = random.Random(11)  # valid text spelled partly in byte tokens, as such models write rare characters
    pieces = {"a": tok.convert_tokens_to_ids("a"), "b": tok.convert_tokens_to_ids("b")}
    for _ in range(200):
        text = "".join(rng.choice("ab中é😀") for _ in range(rng.randint(1, 20)))
        ids = [i for ch in text for i in ([pieces[ch]] if ch in pieces else [byte[b] for b in ch.encode()])]
        deltas = stream(tok, ids)
        assert "".join(deltas) == tok.decode(ids) == text
        assert all("\ufffd" not in d for d in deltas)


def test_stop_string_spanning_tokens_is_never_emitted(llm):
    tok = llm.tokenizer
    text = "The capital of France is Paris. Streaming chat sends text."
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=("is Paris",))
    deltas = []
    for t in ids:
        deltas.append(detok.add(t))
        if detok.stopped:
            break
    joined = "".join(deltas) + detok.flush()
    assert joined == "The capital of France "
    assert all("is P" not in "".join(deltas[: i + 1]) for i in range(len(deltas)))


def test_stop_string_in_engine_output(llm):
    full = greedy(llm, "Hello, world! How are you")
    text = full.text
    stop = text[5:9]
    assert stop and text.find(stop) == 5
    out = greedy(llm, "Hello, world! How are you", stop=[stop])
    assert out.text == text[:5]
    assert out.finish_reason is FinishReason.STOP


def test_stop_token_ids_and_min_tokens(llm):
    full = greedy(llm, "Once upon a time")
    stop_id = full.token_ids[3]
    first = full.token_ids.index(stop_id)
    out = greedy(llm, "Once upon a time", stop_token_ids=[stop_id])
    assert out.token_ids == full.token_ids[: first + 1] and out.finish_reason is FinishReason.STOP
    out = greedy(llm, "Once upon a time", stop_token_ids=[stop_id], min_tokens=8)
    assert len(out.token_ids) >= 8 and stop_id not in out.token_ids[:7]


def test_ignore_eos(llama):
    loaded = load_model(str(llama))
    llm = LLM(loaded)
    full = greedy(llm, "Numbers: 0 1 2")
    eos = full.token_ids[4]
    loaded.model.generation_config.eos_token_id = eos  # pretend the model's EOS is that token
    llm = LLM(loaded)
    stopped = greedy(llm, "Numbers: 0 1 2")
    assert stopped.finish_reason is FinishReason.STOP and stopped.token_ids[-1] == eos
    assert len(stopped.token_ids) <= 5
    going = greedy(llm, "Numbers: 0 1 2", ignore_eos=True)
    assert going.finish_reason is FinishReason.LENGTH and len(going.token_ids) == 20
    assert going.token_ids == full.token_ids


def test_n_samples(llm):
    result = llm.generate(["Tell me a story"], SamplingParams(max_tokens=12, temperature=1.0, seed=5, n=3))[0]
    assert len(result.outputs) == 3
    assert len({tuple(o.token_ids) for o in result.outputs}) == 3  # independent samples
    assert all(len(o.token_ids) == 12 for o in result.outputs)
    greedy2 = llm.generate(["Tell me a story"], SamplingParams(max_tokens=12, temperature=0, n=2))[0]
    assert greedy2.outputs[0].token_ids == greedy2.outputs[1].token_ids


def test_seeded_sampling_same_alone_and_in_a_batch(llm):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    alone = llm.generate(["What is the capital of France?"], params)[0].token_ids
    others = [f"Other prompt number {i} about robots" for i in range(15)]
    batch = llm.generate(others[:7] + ["What is the capital of France?"] + others[7:],
                         [SamplingParams(max_tokens=16, temperature=1.0, seed=i) for i in range(7)] + [params] +
                         [SamplingParams(max_tokens=16, temperature=0.7) for _ in range(8)])
    assert batch[7].token_ids == alone
    other_seed = llm.generate(["What is the capital of France?"], SamplingParams(
        max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=99))[0].token_ids
    assert other_seed != alone


def test_logprobs_match_reference_log_softmax(llm, llama):
    prompt = llm.tokenizer.encode("The quick brown fox", add_special_tokens=False)
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, logprobs=3))[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 6
    ref = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + out.token_ids])).logits[0]
    for i, lp in enumerate(lps):
        expected = torch.log_softmax(logits[len(prompt) - 1 + i], dim=-1)
        assert lp.token_id == out.token_ids[i]
        assert abs(lp.logprob - expected[lp.token_id].item()) < 1e-4
        top_vals, top_ids = expected.topk(3)
        assert [t for t, _ in lp.top] == top_ids.tolist()
        assert max(abs(v - e) for (_, v), e in zip(lp.top, top_vals.tolist())) < 1e-4


def test_penalties_change_greedy_output(llm):
    plain = greedy(llm, "Hello hello hello", max_tokens=30)
    penalized = greedy(llm, "Hello hello hello", max_tokens=30, repetition_penalty=5.0)
    assert penalized.token_ids != plain.token_ids
    # a strong repetition penalty makes repeats of already-seen tokens rarer
    assert len(set(penalized.token_ids)) >= len(set(plain.token_ids))


@pytest.fixture
def engine(llama):
    eng = AsyncEngine(load_model(str(llama)), EngineConfig(max_num_seqs=8)).start()
    yield eng
    eng.shutdown()


def wait_until(pred, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return False


def test_abort_frees_blocks_and_ends_the_stream(engine):
    async def abort_after_five():
        stream = engine.add_request(engine.encode("Tell me a long story"),
                                    SamplingParams(max_tokens=5000 if engine.max_model_len > 5100 else 900,
                                                   temperature=0, ignore_eos=True))
        outs = []
        async for out in stream:
            outs.append(out)
            if len(outs) == 5:
                assert engine.stats().num_running == 1 and engine.stats().kv_usage > 0
                assert stream.abort()
        return outs

    outs = asyncio.run(asyncio.wait_for(abort_after_five(), 60))
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.ABORT
    assert wait_until(lambda: engine.stats().num_running == 0 and engine.stats().kv_usage == 0.0, 1.0)


async def read_to_end(stream) -> tuple[str, RequestOutput]:
    """A stream's answer text and its last output (how it ended)."""
    text = ""
    async for out in stream:
        text += out.text
    return text, out


def test_async_generate_aborts_when_the_consumer_leaves(engine):
    async def consume_three():
        gen = engine.generate(engine.encode("abc"), SamplingParams(max_tokens=900, temperature=0, ignore_eos=True))
        n = 0
        async for _ in gen:
            n += 1
            if n == 3:
                break
        await gen.aclose()

    asyncio.run(consume_three())
    assert wait_until(lambda: engine.stats().num_running == 0 and engine.stats().kv_usage == 0.0, 1.0)


def test_fault_in_one_request_leaves_the_others_intact(engine, llm):
    prompts = [f"Request {i}: say something" for i in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0)
    expected = [r.text for r in llm.generate(prompts, params)]

    async def run():
        streams = [engine.add_request(engine.encode(p), params) for p in prompts]
        engine.inject_fault(streams[1].request_id)
        return await asyncio.gather(*map(read_to_end, streams))

    answers = asyncio.run(asyncio.wait_for(run(), 60))
    assert answers[1][1].finish_reason is FinishReason.ERROR and "failed" in answers[1][1].error
    for i in (0, 2, 3):
        assert answers[i][0] == expected[i] and answers[i][1].finish_reason is FinishReason.LENGTH
    assert engine.alive


def test_nan_logits_fail_only_that_request(engine, llm):
    params = SamplingParams(max_tokens=8, temperature=0)
    expected = llm.generate(["good one"], params)[0].text
    run = engine.core.runner.run

    def poisoned(plan):
        logits = run(plan).clone()
        for row, chunk in enumerate(c for c in plan if c.samples):
            if chunk.seq.request_id == "poison":
                logits[row] = float("nan")
        return logits

    engine.core.runner.run = poisoned

    async def bad_and_good():
        return await asyncio.gather(read_to_end(engine.add_request(engine.encode("bad one"), params, "poison")),
                                    read_to_end(engine.add_request(engine.encode("good one"), params)))

    (bad_text, bad_end), (good_text, _) = asyncio.run(asyncio.wait_for(bad_and_good(), 60))
    assert bad_text == "" and bad_end.finish_reason is FinishReason.ERROR
    assert "NaN" in bad_end.error and good_text == expected


def test_non_finite_logits_from_the_native_step_fail_the_request(llama):
    # The native step hands the sampler each row's argmax, or -1 for a row with a NaN or inf: such a
    # step falls back to the sampler's own checks, which fail the request with the reason.
    llm = LLM(load_model(str(llama)))
    assert llm.core.runner.native is not None and llm.core.runner.native.head is not None
    norm = llm.core.model.model.norm.weight  # read by the C step in place
    with torch.no_grad():
        norm[0] = float("inf")
    result = llm.generate(["good one"], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
    assert result.token_ids == [] and result.finish_reason is FinishReason.ERROR


def test_queue_full_and_invalid_prompt(llama):
    from engine import InvalidRequest, QueueFull

    eng = AsyncEngine(load_model(str(llama)), EngineConfig(max_num_seqs=1, max_queue=1))  # not started
    p = SamplingParams(max_tokens=4)

    async def add_three():
        eng.add_request([5, 6], p)
        eng.add_request([5, 6], p)
        with pytest.raises(QueueFull, match="capacity"):
            eng.add_request([5, 6], p)

    asyncio.run(add_three())
    with pytest.raises(InvalidRequest, match=r"beyond this model's context of 1024 tokens"):
        eng.check_prompt([5] * 1000, SamplingParams(max_tokens=100))
    with pytest.raises(InvalidRequest, match="empty"):
        eng.check_prompt([], p)


def test_prompt_token_ids_outside_the_vocabulary_are_refused(llama, llm):
    from engine import InvalidRequest

    vocab = llm.core.vocab_size
    for bad, position in (([-1], 0), ([5, vocab], 1), ([5, 6, 10**6], 2), ([5, True], 1)):
        with pytest.raises(InvalidRequest) as err:
            llm.generate([bad], SamplingParams(max_tokens=2))
        assert str(err.value) == (f"Prompt token ids must be integers in [0, {vocab}) (this model's vocabulary of "
                                  f"{vocab} tokens). Given: {bad[position]!r} at position {position}.")
        assert err.value.param == "prompt"
    eng = AsyncEngine(load_model(str(llama)))  # not started: refused before anything is queued
    with pytest.raises(InvalidRequest, match=r"in \[0, \d+\).*Given: 1000000 at position 0"):
        eng.add_request([10**6], SamplingParams(max_tokens=2))
    assert eng.stats().num_waiting == 0
    assert llm.generate([[5, vocab - 1]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids  # the edge is fine


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-8])
def test_a_tiny_temperature_samples_like_greedy_never_nan(llm, temperature):
    prompt = "Tell me about the sea"
    expected = greedy(llm, prompt, max_tokens=16, ignore_eos=True).token_ids
    for seed in (None, 3):
        params = SamplingParams(max_tokens=16, temperature=temperature, seed=seed, ignore_eos=True,
                                top_p=0.9, top_k=40)
        assert llm.generate([prompt], params)[0].token_ids == expected
        plain = SamplingParams(max_tokens=16, temperature=temperature, seed=seed, ignore_eos=True)
        assert llm.generate([prompt], plain)[0].token_ids == expected


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1}, "`temperature` must be a number in [0, 100] (0 = greedy). Given: -1"),
    ({"top_p": 0}, "`top_p` must be in (0, 1]. Given: 0"),
    ({"max_tokens": 0}, "`max_tokens` must be an integer >= 1. Given: 0"),
    ({"n": 50}, "`n` must be an integer between 1 and 16. Given: 50"),
])
def test_sampling_params_validation(kwargs, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert str(err.value) == message


def test_the_cpu_kv_pool_reads_as_zeros_before_any_write():
    """On CPU the pool is the OS's anonymous memory: never-written slots read as zeros with no
    zeroing pass (a NaN there would poison masked attention), and pages are only committed once
    written."""
    cache = PagedKVCache(2, 4096, 16, 3, 64, torch.float32, torch.device("cpu"))
    assert all(t.abs().sum().item() == 0 for t in (*cache.keys, *cache.values))
    assert all(cache._zeroed)  # nothing left for zero_new_blocks to do
    cache.keys[1][16:32].fill_(2.0)  # a block written, its neighbours untouched
    assert cache.keys[1][:16].abs().sum().item() == 0 and cache.keys[1][32:].abs().sum().item() == 0
    assert cache.keys[1][16:32].sum().item() == 2.0 * 16 * 3 * 64


def test_unwritten_cache_memory_never_leaks_into_attention(llama, llm):
    """A KV pool allocated uninitialized (torch.empty, as on a GPU) is zeroed a block at a time when
    first handed out: garbage (here: NaN everywhere) in slots a sequence has not written must not
    reach its attention, even though they are masked out."""
    poisoned = LLM(load_model(str(llama)), EngineConfig(num_kv_blocks=64, block_size=16))
    cache = poisoned.core.runner.cache
    for t in (*cache.keys, *cache.values):
        t.fill_(float("nan"))
    cache._zeroed = bytearray(cache.num_blocks)
    cache.zero_new_blocks([0])
    prompts = ["Hello there", "Once upon a time there was a robot", "x"]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    got = poisoned.generate(prompts, params)
    assert [r.finish_reason for r in got] == [FinishReason.LENGTH] * 3
    assert [r.token_ids for r in got] == [r.token_ids for r in llm.generate(prompts, params)]


def drain(core) -> tuple[list[int], list[str], object]:
    """Step until idle: the tokens, the text each output carried, and the last output."""
    tokens, pieces, last = [], [], None
    while core.has_work():
        for out in core.step():
            tokens += out.token_ids
            pieces.append(out.text)
            last = out
    return tokens, pieces, last


def test_a_request_continues_from_prior_output_as_if_never_stopped(llm):
    """What a resumed /chat stream relies on: prompt + the tokens generated so far, recomputed,
    go on with exactly the greedy tokens of the uninterrupted request, and the text shown before
    the cut plus the continuation's is its text, wherever the cut falls: also inside a character
    whose bytes span tokens, whose text the stream was still holding back when it was cut."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompt = llm.core.tokenizer.encode("Once upon a time, in a land of robots", add_special_tokens=False)
    core = llm.core
    core.add_request("whole", prompt, params)
    ids, shown, _ = drain(core)  # one token an output: shown[i] is what token i released
    full = "".join(shown)
    assert full == llm.generate([prompt], params)[0].text
    held = [cut for cut in range(1, 40) if "".join(shown[:cut]) != core.tokenizer.decode(ids[:cut])]
    assert held, "the random model's output should hold text back at some cut (a character in bytes)"
    for cut in sorted({1, 13, *held[:6]}):
        counted = core.stats().prompt_tokens_total
        core.add_request(f"continued-{cut}", prompt, params, prior_output_ids=ids[:cut])
        tokens, pieces, last = drain(core)
        assert tokens == ids[cut:]
        assert "".join(shown[:cut]) + "".join(pieces) == full, cut
        assert last.finished and last.finish_reason == FinishReason.LENGTH and last.num_output_tokens == 40
        assert core.allocator.num_free == core.num_kv_blocks
        if cut == 13:  # its prompt came from the prefix cache (the cached run reaches past it): nothing to count
            assert core.stats().prompt_tokens_total == counted


def test_an_aborted_stream_shows_nothing_it_held_back(llm):
    """A cut shows only what was released: the abort does not flush the held bytes (a resumed
    stream's continuation releases them in context; on a remote backend the abort never comes
    back from the replica with text, so flushing here would make the backends disagree)."""
    core = llm.core
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompt = core.tokenizer.encode("Once upon a time, in a land of robots", add_special_tokens=False)
    core.add_request("whole", prompt, params)
    ids, shown, _ = drain(core)
    cut = next(cut for cut in range(1, 40) if "".join(shown[:cut]) != core.tokenizer.decode(ids[:cut]))
    core.add_request("cut", prompt, params)
    texts = []
    while len(texts) < cut:
        texts += [out.text for out in core.step()]
    (aborted,) = core.abort("cut")
    assert aborted.finish_reason == FinishReason.ABORT and aborted.text == ""
    assert "".join(texts) == "".join(shown[:cut])


def test_a_prompt_longer_than_the_step_budget_alone(llama):
    """The first steps of a lone long prompt sample nothing (its chunks continue): it must still
    come out right, as the same prompt does with a budget that fits it at once."""
    prompt = list(range(5, 5 + 700))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    chunked = LLM(load_model(str(llama)), EngineConfig(max_num_batched_tokens=256)).generate([prompt], params)[0]
    whole = LLM(load_model(str(llama)), EngineConfig(max_num_batched_tokens=1024)).generate([prompt], params)[0]
    assert chunked.finish_reason == FinishReason.LENGTH and len(chunked.token_ids) == 8
    assert chunked.token_ids == whole.token_ids
