"""Faults inside the engine, on a tiny random Llama: a real exception or NaN from the model fails
only the request it concerns, so does a fault in bookkeeping, sampling or output dispatch; a
failed add gives its capacity back; a dead engine ends every consumer, then rebuilds or stays
dead; the KV pool is sized by the container's memory limit."""

import asyncio
import threading
import time
from dataclasses import dataclass

import pytest
import torch

from engine import LLM, AsyncEngine, EngineConfig, FinishReason, SamplingParams
from engine.async_engine import EngineNotRunning
from engine.model.memory import container_free_memory, free_memory_bytes
from engine.model.loading import load_model

PROMPTS = [f"Request {i}: tell me about the sea" for i in range(4)]
PARAMS = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def alone(llama):
    """Each prompt's greedy answer, computed alone."""
    llm = LLM(load_model(str(llama)))
    return {p: llm.generate([p], PARAMS)[0].outputs[0].token_ids for p in PROMPTS}


def poison_id(engine, alone) -> int:
    """A token id in none of PROMPTS nor their answers (the faulty request's prompt carries it)."""
    used = {t for p in PROMPTS for t in engine.encode(p) + alone[p]}
    return next(t for t in range(999, 100, -1) if t not in used)


@dataclass
class Answer:
    """One request as its reader saw it: the answer's text and how it ended."""

    text: str = ""
    finish_reason: FinishReason | None = None
    error: str | None = None


async def read(stream) -> Answer:
    """A request's `RequestStream` read to its end, as the routes read theirs."""
    answer = Answer()
    async for out in stream:
        answer.text += out.text
        if out.finished:
            answer.finish_reason, answer.error = out.finish_reason, out.error
    return answer


def answer_to(engine: AsyncEngine, prompt_ids: list[int], params=PARAMS) -> Answer:
    """One request, added and read to its end in an event loop of its own."""
    async def run():
        return await read(engine.add_request(prompt_ids, params))

    return asyncio.run(asyncio.wait_for(run(), 60))


def batched(engine: AsyncEngine, prompts_ids: list[list[int]], params=PARAMS) -> list[Answer]:
    """Admits every request before the engine thread starts, so that they share their steps."""
    async def run():
        streams = [engine.add_request(ids, params) for ids in prompts_ids]
        engine.start()
        return await asyncio.gather(*map(read, streams))

    return asyncio.run(asyncio.wait_for(run(), 120))


def token_ids_of(engine: AsyncEngine, prompt: str) -> list[int]:
    """What the engine answers to `prompt` now, alone (checks that it still serves)."""
    out = []

    async def run():
        async for delta in engine.generate(engine.encode(prompt), PARAMS):
            out.extend(delta.token_ids)

    asyncio.run(run())
    return out


def texts_alone(engine, alone) -> list[str]:
    return [engine.tokenizer.decode(alone[p]) for p in PROMPTS]


def nothing_admitted(engine) -> bool:
    """No sequence counts against the engine's capacity: none running, none waiting to be added."""
    stats = engine.stats()
    return stats.num_running == stats.num_waiting == 0


# --------------------------------------------------------------------------- the model itself fails


@pytest.mark.parametrize("arch", ["llama", "bloom"])  # the paged path; the fallback path (a cache per sequence)
def test_a_layer_raising_for_one_sequence_fails_only_that_request(tiny_model, arch, caplog):
    path = str(tiny_model(arch))
    llm = LLM(load_model(path))
    answers = {p: llm.generate([p], PARAMS)[0].outputs[0].token_ids for p in PROMPTS}
    engine = AsyncEngine(load_model(path))
    bad = next(t for t in range(999, 100, -1)
               if all(t not in engine.encode(p) and t not in answers[p] for p in PROMPTS))

    def raise_on_poison(module, args):  # a real exception from inside the model's forward
        if bool((args[0] == bad).any()):
            raise ValueError(f"embedding refused token {bad}")

    engine.loaded.model.get_input_embeddings().register_forward_pre_hook(raise_on_poison)
    try:
        results = batched(engine, [engine.encode(p) for p in PROMPTS[:2]] + [[5, bad, 6, 7]]
                           + [engine.encode(p) for p in PROMPTS[2:]])
        faulty = results.pop(2)
        assert faulty.text == "" and faulty.finish_reason is FinishReason.ERROR
        assert "running the model" in faulty.error and "refused" not in faulty.error  # the log has the cause
        assert f"embedding refused token {bad}" in caplog.text
        assert [s.text for s in results] == texts_alone(engine, answers)
        assert all(s.finish_reason is FinishReason.LENGTH for s in results)
        assert engine.alive and engine.num_restarts == 0
        assert token_ids_of(engine, PROMPTS[0]) == answers[PROMPTS[0]]
        assert nothing_admitted(engine) and engine.stats().num_free_kv_blocks == engine.stats().num_kv_blocks
    finally:
        engine.shutdown()


def test_nan_weights_in_one_embedding_row_fail_only_the_request_that_reads_it(llama, alone):
    engine = AsyncEngine(load_model(str(llama)))
    bad = poison_id(engine, alone)
    with torch.no_grad():
        engine.loaded.model.model.embed_tokens.weight[bad] = float("nan")
    try:
        results = batched(engine, [[5, bad, 6, 7]] + [engine.encode(p) for p in PROMPTS])
        faulty = results.pop(0)
        assert faulty.text == "" and faulty.finish_reason is FinishReason.ERROR and "NaN" in faulty.error
        assert [s.text for s in results] == texts_alone(engine, alone)
        assert engine.alive
    finally:
        engine.shutdown()


# --------------------------------------------------------------------------- the other stages of a step


def _break_allocator(engine, bad_first_token):
    cache_full_blocks = engine.core.allocator.cache_full_blocks

    def broken(token_ids, *args):
        if token_ids[0] == bad_first_token:
            raise KeyError("block hash table out of step")
        return cache_full_blocks(token_ids, *args)

    engine.core.allocator.cache_full_blocks = broken


def _break_sampler(engine, bad_first_token):
    sample = engine.core.sampler.sample

    def broken(logits, seqs):
        if any(s.token_ids[0] == bad_first_token for s in seqs):
            raise IndexError("penalty row out of range")
        return sample(logits, seqs)

    engine.core.sampler.sample = broken


@pytest.mark.parametrize("stage, breaks, expected", [
    ("prefix-cache bookkeeping", _break_allocator, "recording the computed tokens"),
    ("sampler", _break_sampler, "sampling the next token"),
])
def test_a_fault_in_one_sequences_step_fails_only_it(llama, alone, stage, breaks, expected):
    engine = AsyncEngine(load_model(str(llama)))
    bad_first_token = 3  # no encoded prompt starts with it (asserted below)
    assert all(engine.encode(p)[0] != bad_first_token for p in PROMPTS)
    breaks(engine, bad_first_token)
    try:
        results = batched(engine, [[bad_first_token, 9, 10, 11]] + [engine.encode(p) for p in PROMPTS])
        faulty = results.pop(0)
        assert faulty.finish_reason is FinishReason.ERROR and expected in faulty.error, stage
        assert [s.text for s in results] == texts_alone(engine, alone), stage
        assert engine.alive and engine.num_restarts == 0
        assert nothing_admitted(engine)
    finally:
        engine.shutdown()


def test_a_request_whose_readers_event_loop_closed_is_aborted_alone(llama, alone):
    """Its reader is gone with its loop: the request stops (its KV blocks free), the others go on."""
    engine = AsyncEngine(load_model(str(llama)))
    long = SamplingParams(max_tokens=900, temperature=0, ignore_eos=True)
    try:
        gone = asyncio.new_event_loop()

        async def add():
            return engine.add_request(engine.encode("nobody reads this"), long)

        gone.run_until_complete(add())
        gone.close()
        answers = batched(engine, [engine.encode(p) for p in PROMPTS])
        assert [a.text for a in answers] == texts_alone(engine, alone)
        assert wait_until(lambda: nothing_admitted(engine), 1.0)
        stats = engine.stats()
        assert stats.finished_total.get("abort") == 1 and stats.num_free_kv_blocks == stats.num_kv_blocks
        assert engine.alive and engine.num_restarts == 0
    finally:
        engine.shutdown()


# --------------------------------------------------------------------------- failed adds


def test_a_failed_add_gives_its_capacity_back(llama):
    engine = AsyncEngine(load_model(str(llama)), EngineConfig(max_num_seqs=1, max_queue=0))  # room for one
    try:
        engine.start()
        with pytest.raises(RuntimeError, match="read in an event loop"):  # a stream outside a loop
            engine.add_request(engine.encode("hi"), PARAMS)
        assert nothing_admitted(engine)
        add_request = engine.core.add_request

        def out_of_memory(request_id, *args):  # accepted by _admit, then refused on the engine thread
            raise MemoryError("no room for the detokenizer")

        engine.core.add_request = out_of_memory
        refused = answer_to(engine, engine.encode("hi"), SamplingParams(max_tokens=4))
        engine.core.add_request = add_request
        assert refused.text == "" and refused.finish_reason is FinishReason.ERROR
        assert "adding this request" in refused.error
        assert nothing_admitted(engine)
        answer = answer_to(engine, engine.encode("hi"))  # the one slot is free
        assert answer.text and answer.finish_reason is FinishReason.LENGTH
    finally:
        engine.shutdown()


# --------------------------------------------------------------------------- engine death


def wait_until(predicate, timeout: float = 60.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def _kill(engine) -> None:
    """What /_test/kill-engine does: the next step raises outside the core's isolation."""
    def die():
        raise RuntimeError("killed by the test")

    engine.core.step = die


def test_engine_death_ends_the_readers_of_every_event_loop_then_the_engine_rebuilds(llama, alone):
    engine = AsyncEngine(load_model(str(llama))).start()
    long = SamplingParams(max_tokens=900, temperature=0, ignore_eos=True)
    ended = {}
    started = threading.Event()

    async def other_loop():  # a reader on another thread's event loop
        outs = []
        async for out in engine.add_request(engine.encode("other loop"), long):
            outs.append(out)
            started.set()
        ended["other loop"] = outs[-1]

    async def readers():
        streams = [engine.add_request(engine.encode(f"reader {i}"), long) for i in range(2)]
        first = await streams[0].next()  # generating
        _kill(engine)
        answers = await asyncio.gather(*map(read, streams))  # they end: no hang
        answers[0].text = first.text + answers[0].text
        return answers

    thread = threading.Thread(target=lambda: asyncio.run(other_loop()))
    try:
        thread.start()
        assert started.wait(60)
        answers = asyncio.run(asyncio.wait_for(readers(), 60))
        thread.join(60)
        assert not thread.is_alive()
        assert ended["other loop"].finish_reason is FinishReason.ERROR
        assert "engine stopped" in ended["other loop"].error
        for answer in answers:
            assert answer.finish_reason is FinishReason.ERROR and "engine stopped" in answer.error
            assert len(engine.tokenizer.encode(answer.text)) < 900
        assert wait_until(lambda: engine.alive), "the engine did not come back"
        assert token_ids_of(engine, PROMPTS[0]) == alone[PROMPTS[0]]  # rebuilt, and right
        assert engine.alive and engine.num_restarts == 1 and nothing_admitted(engine)
    finally:
        engine.shutdown()


def test_past_max_restarts_the_engine_stays_dead_and_calls_on_fatal(llama):
    engine = AsyncEngine(load_model(str(llama)), EngineConfig(max_restarts=0))
    fatal = []
    done = threading.Event()
    engine.on_fatal = lambda exc: (fatal.append(exc), done.set())
    try:
        engine.start()
        async def killed() -> Answer:
            stream = engine.add_request(engine.encode("hi"), SamplingParams(max_tokens=900, ignore_eos=True))
            await stream.next()  # generating
            _kill(engine)
            return await read(stream)

        assert asyncio.run(asyncio.wait_for(killed(), 60)).finish_reason is FinishReason.ERROR
        assert done.wait(30) and "killed by the test" in str(fatal[0])
        assert not engine.alive
        with pytest.raises(EngineNotRunning, match="stopped after an internal error"):
            answer_to(engine, engine.encode("hi"))
        assert engine._shares.total == 0  # the refusal counted nothing (a dead core's own stats stay as they were)
    finally:
        engine.shutdown()


def test_a_forward_failing_for_everyone_three_steps_in_a_row_kills_the_engine(llama):
    """A broken device fails every forward: after MAX_FAILED_STEPS such steps the engine dies, so
    that max_restarts and on_fatal apply, instead of failing every request forever while alive."""
    from engine.core import MAX_FAILED_STEPS, ModelBroken

    engine = AsyncEngine(load_model(str(llama)), EngineConfig(max_restarts=0))
    fatal = []
    done = threading.Event()
    engine.on_fatal = lambda exc: (fatal.append(exc), done.set())

    def broken_device(module, args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    hook = engine.loaded.model.get_input_embeddings().register_forward_pre_hook(broken_device)
    try:
        engine.start()
        errors = []
        for i in range(MAX_FAILED_STEPS):  # one request at a time: each step fails for all it runs
            failed = answer_to(engine, engine.encode(f"request {i}"))
            assert failed.text == "" and failed.finish_reason is FinishReason.ERROR
            errors.append(failed.error)
        assert all("running the model" in e for e in errors[:-1])
        assert "engine stopped" in errors[-1]  # the last one ends with the engine
        assert done.wait(30) and isinstance(fatal[0], ModelBroken)
        assert f"every sequence in {MAX_FAILED_STEPS} steps in a row" in str(fatal[0])
        assert not engine.alive
    finally:
        hook.remove()
        engine.shutdown()


def test_a_forward_failing_now_and_then_does_not_count_as_broken(llama, alone):
    from engine.core import MAX_FAILED_STEPS

    engine = AsyncEngine(load_model(str(llama)), EngineConfig(max_restarts=0))
    failing = {"on": True}

    def sometimes(module, args):
        if failing["on"]:
            raise RuntimeError("transient")

    hook = engine.loaded.model.get_input_embeddings().register_forward_pre_hook(sometimes)
    try:
        engine.start()
        for _ in range(MAX_FAILED_STEPS):  # a failing step, then a good one: the count starts again
            failing["on"] = True
            failed = answer_to(engine, engine.encode("fails"))
            assert failed.text == "" and failed.finish_reason is FinishReason.ERROR
            failing["on"] = False
            assert token_ids_of(engine, PROMPTS[0]) == alone[PROMPTS[0]]
        assert engine.alive and engine.num_restarts == 0
    finally:
        hook.remove()
        engine.shutdown()


def test_a_rebuilt_engine_keeps_its_kv_pool_size_and_linears(llama, monkeypatch):
    """The old pool's memory is still held when the new core is sized (the allocator keeps it):
    sized from free memory again, each restart would shrink the pool."""
    from engine.model import memory as core

    free = iter([1 << 30, 256 << 20, 64 << 20])  # what free memory reads at each sizing
    monkeypatch.setattr(core, "free_memory_bytes", lambda device, *args: next(free))
    engine = AsyncEngine(load_model(str(llama)), EngineConfig(kv_cache_memory=0.5)).start()
    try:
        blocks, linears = engine.core.num_kv_blocks, engine.core.linears
        for restart in (1, 2):
            _kill(engine)
            engine.core.has_work = lambda: True  # dies at its next loop, with nothing running
            assert wait_until(lambda: engine.num_restarts == restart and engine.alive), "no rebuild"
            assert engine.core.num_kv_blocks == blocks and engine.stats().num_kv_blocks == blocks
            assert engine.core.linears == linears
        assert token_ids_of(engine, PROMPTS[0])  # and it serves
    finally:
        engine.shutdown()


def test_engine_death_ends_the_samples_still_running_under_their_own_index(llama):
    """Sample 0 of an n=3 request stops early (a stop token only it draws, found offline with the
    same seed); the engine then dies: samples 1 and 2 get the error end, not 0 twice."""
    llm = LLM(load_model(str(llama)))
    prompt = llm.tokenizer.encode("Tell me a story", add_special_tokens=False)
    for seed in range(50):
        sampled = SamplingParams(max_tokens=300, temperature=5.0, seed=seed, n=3, ignore_eos=True)
        outs = llm.generate([prompt], sampled)[0].outputs
        others = set(outs[1].token_ids) | set(outs[2].token_ids)
        stop = next((t for t in outs[0].token_ids[:3] if t not in others), None)
        if stop is not None:
            break
    assert stop is not None, "no seed gives sample 0 a stop token of its own"
    params = SamplingParams(max_tokens=300, temperature=5.0, seed=seed, n=3, ignore_eos=True,
                            stop_token_ids=(stop,))
    engine = AsyncEngine(load_model(str(llama))).start()
    ends: dict[int, list] = {}

    async def consume():
        async for out in engine.add_request(prompt, params):
            if out.finished:
                ends.setdefault(out.index, []).append(out)
                if out.index == 0:
                    _kill(engine)

    try:
        asyncio.run(asyncio.wait_for(consume(), 60))
        assert sorted(ends) == [0, 1, 2] and all(len(v) == 1 for v in ends.values())
        assert ends[0][0].finish_reason is FinishReason.STOP
        for index in (1, 2):
            assert ends[index][0].finish_reason is FinishReason.ERROR and "engine stopped" in ends[index][0].error
    finally:
        engine.shutdown()


# --------------------------------------------------------------------------- memory


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_and_v1_limits_less_the_working_set(tmp_path):
    v2 = tmp_path / "v2"
    write(v2 / "memory.max", "1073741824\n")  # 1 GiB
    write(v2 / "memory.current", str(600 << 20))
    write(v2 / "memory.stat", "anon 100\ninactive_file 104857600\nactive_file 5\n")  # 100 MiB reclaimable
    assert container_free_memory(v2) == (1 << 30) - (500 << 20)
    v1 = tmp_path / "v1"
    write(v1 / "memory" / "memory.limit_in_bytes", str(2 << 30))
    write(v1 / "memory" / "memory.usage_in_bytes", str(1 << 30))
    write(v1 / "memory" / "memory.stat", "total_inactive_file 0\n")
    assert container_free_memory(v1) == 1 << 30
    unlimited = tmp_path / "none"
    write(unlimited / "memory.max", "max\n")
    write(unlimited / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")
    assert container_free_memory(unlimited) is None
    assert container_free_memory(tmp_path / "absent") is None
    meminfo = tmp_path / "meminfo"
    write(meminfo, "MemTotal: 67108864 kB\nMemAvailable: 33554432 kB\n")  # the host: 32 GiB free
    cpu = torch.device("cpu")
    assert free_memory_bytes(cpu, meminfo, v2) == (1 << 30) - (500 << 20)  # the container is smaller
    assert free_memory_bytes(cpu, meminfo, unlimited) == 32 << 30


def test_the_default_kv_pool_fits_the_container_limit_not_the_host(llama, tmp_path, monkeypatch):
    from engine.model import memory as core

    write(tmp_path / "meminfo", "MemAvailable: 268435456 kB\n")  # a big host: 256 GiB available
    write(tmp_path / "cg" / "memory.max", str(64 << 20))  # a container of 64 MiB
    write(tmp_path / "cg" / "memory.current", "0")
    monkeypatch.setattr(core, "MEMINFO_PATH", tmp_path / "meminfo")
    monkeypatch.setattr(core, "CGROUP_ROOT", tmp_path / "cg")
    llm = LLM(load_model(str(llama)))
    per_block = llm.core.kv_cache_bytes // llm.core.num_kv_blocks
    assert llm.core.num_kv_blocks == (64 << 20) // 4 // per_block  # a quarter of what the limit leaves
    assert llm.core.kv_cache_bytes <= 16 << 20
    monkeypatch.setattr(core, "CGROUP_ROOT", tmp_path / "no-cgroup")
    roomy = LLM(load_model(str(llama)))
    assert roomy.core.num_kv_blocks > llm.core.num_kv_blocks  # without the limit: every sequence at full context
