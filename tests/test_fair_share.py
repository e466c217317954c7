"""Fair shares between clients without HTTP: the scheduler's virtual token counters (fake
sequences, no model) and the engine's admission past a full queue (a tiny model, not stepping)."""

import asyncio
import time

import pytest

from engine import AsyncEngine, EngineConfig, FinishReason, SamplingParams
from engine.kv_cache import BlockAllocator
from engine.model.loading import load_model
from engine.request import QueueFull, Sequence
from engine.scheduler import Scheduler


def seq(name: str, client, prompt_len: int = 8) -> Sequence:
    return Sequence(seq_id=name, request_id=name, index=0, token_ids=list(range(prompt_len)),
                    num_prompt_tokens=prompt_len, params=SamplingParams(max_tokens=64), client=client)


def step(sched: Scheduler) -> list[str]:
    """One step as the engine takes it: the plan's tokens computed; returns who ran."""
    plan = sched.schedule()
    for chunk in plan:
        chunk.seq.num_computed_tokens += chunk.num_tokens
        if chunk.samples:
            chunk.seq.token_ids.append(7)
    return [chunk.seq.seq_id for chunk in plan]


def admissions(sched: Scheduler, finish_each: int = 3) -> list[str]:
    """Who is admitted, in order, when each running sequence finishes after `finish_each` steps."""
    order, ages = [], {}
    while sched.has_work():
        for name in step(sched):
            if name not in ages:
                order.append(name)
            ages[name] = ages.get(name, 0) + 1
        for running in list(sched.running):
            if ages[running.seq_id] >= finish_each:
                sched.finish(running)
    return order


def test_a_second_client_goes_ahead_of_the_first_ones_queue_at_the_next_step():
    sched = Scheduler(BlockAllocator(100, 16), max_num_seqs=2, max_num_batched_tokens=256)
    a = [seq(f"a{i}", "A") for i in range(6)]
    for s in a:
        sched.add(s)
    assert step(sched) == ["a0", "a1"]  # alone, A takes every slot
    sched.add(seq("b0", "B"))
    assert sched.fair.counters["B"] == sched.fair.counters["A"] == 16  # B comes in at A's level
    # A runs both slots, over its share of one: its latest gives its slot up, B takes it at once
    # (A's decode raised A's counter above B's before the pick)
    assert step(sched) == ["a0", "b0"]
    assert sched.num_preemptions == 1 and list(sched.waiting)[:2] == [a[1], a[2]]
    assert step(sched) == ["a0", "b0"]  # B runs: nobody waits with nothing running, no more preemption
    assert admissions(sched)[2:] == ["a1", "a2", "a3", "a4", "a5"]  # after a0 and b0: A's queue in order
    assert sched.num_preemptions == 1


def test_without_a_waiting_newcomer_or_over_its_share_nobody_is_preempted():
    sched = Scheduler(BlockAllocator(100, 16), max_num_seqs=4, max_num_batched_tokens=256)
    for name, client in (("a0", "A"), ("a1", "A"), ("b0", "B"), ("b1", "B")):
        sched.add(seq(name, client))
    step(sched)
    sched.add(seq("c0", "C"))  # A and B hold 2 slots each, C's share is 4 / 3: 2 > 1.33, so one goes
    assert step(sched)[-1] == "c0" and sched.num_preemptions == 1
    sched.add(seq("a9", "A"))  # A waits, but it runs already: it waits for a slot to free
    step(sched)
    assert sched.num_preemptions == 1


def test_clients_alternate_by_tokens_computed_and_fifo_within_each():
    sched = Scheduler(BlockAllocator(100, 16), max_num_seqs=1, max_num_batched_tokens=256)
    for name in ("a0", "a1", "a2"):
        sched.add(seq(name, "A"))
    for name in ("b0", "b1", "b2"):
        sched.add(seq(name, "B"))
    assert admissions(sched) == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_a_client_back_from_idle_is_lifted_to_the_active_ones_and_earns_no_credit():
    sched = Scheduler(BlockAllocator(200, 16), max_num_seqs=1, max_num_batched_tokens=256)
    sched.add(seq("c0", "C"))
    admissions(sched)  # C was served once, then went idle while A worked for long
    sched.add(seq("a0", "A"))
    sched.add(seq("a1", "A"))
    for _ in range(50):
        step(sched)
    assert sched.fair.counters["A"] > 50
    for name in ("c1", "c2", "c3"):
        sched.add(seq(name, "C"))
    assert sched.fair.counters["C"] == sched.fair.counters["A"]  # lifted: its idle time earned nothing
    sched.finish(sched.running[0])
    # without the lift C's three would all go before a1 (C's counter far below A's); lifted, C ties
    # with A and the earlier in the queue goes first
    assert admissions(sched) == ["a1", "c1", "c2", "c3"]


def test_one_client_or_none_is_plain_fifo():
    for client in (None, "A"):
        sched = Scheduler(BlockAllocator(100, 16), max_num_seqs=2, max_num_batched_tokens=256)
        for i in range(5):
            sched.add(seq(f"s{i}", client, prompt_len=4 + 8 * (i % 2)))
        assert admissions(sched) == [f"s{i}" for i in range(5)]


def test_counters_are_forgotten_when_the_engine_is_idle():
    sched = Scheduler(BlockAllocator(100, 16), max_num_seqs=2, max_num_batched_tokens=256)
    sched.add(seq("a0", "A"))
    sched.add(seq("b0", "B"))
    admissions(sched)
    assert sched.fair.counters == {} and not sched.fair.active and not sched.fair.waiting


def test_waiting_sequences_finished_before_running_leave_the_counts_right():
    seqs = [seq("a0", "A"), seq("a1", "A"), seq("b0", "B")]
    sched = Scheduler(BlockAllocator(100, 16), max_num_seqs=1, max_num_batched_tokens=256)
    for s in seqs:
        sched.add(s)
    step(sched)
    sched.finish(seqs[2])  # aborted while waiting
    assert dict(sched.fair.waiting) == {"A": 1} and dict(sched.fair.active) == {"A": 2}


# --------------------------------------------------------------------------- admission (429)


@pytest.fixture(scope="module")
def llama(tiny_model):
    return str(tiny_model("llama"))


def test_past_a_full_queue_a_client_under_its_share_is_admitted(llama):
    engine = AsyncEngine(load_model(llama), EngineConfig(max_num_seqs=2, max_queue=2))  # not started: nothing ends
    prompt, one, four = [5, 6], SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, n=4)

    async def admissions():  # streams are made in an event loop
        engine.add_request(prompt, four, client="A")  # capacity 4: all A's
        with pytest.raises(QueueFull, match=r"capacity \(2 running and 2 waiting\)\. Retry"):
            engine.add_request(prompt, one, client="A")  # alone, A's share is everything: as before
        engine.add_request(prompt, one, client="B")  # B holds nothing: its share is 4 / 2
        engine.add_request(prompt, one, client="B")
        with pytest.raises(QueueFull, match="this client holds 2 of them, its fair share being 2 with 2 clients"):
            engine.add_request(prompt, one, client="B")
        with pytest.raises(QueueFull):
            engine.add_request(prompt, one, client="A")  # A is far over its share
        with pytest.raises(QueueFull):
            engine.add_request(prompt, SamplingParams(max_tokens=4, n=2), client="C")  # 2 > 4 / 3
        engine.add_request(prompt, one, client="C")
        engine.add_request(prompt, one)  # the anonymous client is one more: 0 + 1 <= 4 / 4
        assert engine.stats().num_waiting == 8  # admitted, none added to the core yet
        with pytest.raises(QueueFull):  # twice the capacity in all: memory stays bounded
            engine.add_request(prompt, one, client="D")

    asyncio.run(admissions())


def test_each_finished_sequence_gives_its_clients_share_back(llama):
    engine = AsyncEngine(load_model(llama), EngineConfig(max_num_seqs=2, max_queue=2)).start()
    try:
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

        async def clients():
            streams = [engine.add_request([5, 6], SamplingParams(max_tokens=3, n=4, ignore_eos=True), client="A"),
                       engine.add_request([5, 6], params, client="B"),
                       engine.add_request([5, 6], params, client="C")]
            engine.abort(streams[1].request_id)
            return [out async for out in streams[0]], [out async for out in streams[2]]

        outs, c_outs = asyncio.run(asyncio.wait_for(clients(), 60))
        assert sum(o.finished for o in outs) == 4 and c_outs[-1].finish_reason is FinishReason.LENGTH
        deadline = time.monotonic() + 10
        while (engine.stats().num_running or engine.stats().num_waiting) and time.monotonic() < deadline:
            time.sleep(0.05)  # the abort lands within a step
        assert engine.stats().num_running == engine.stats().num_waiting == 0 and not engine._shares.held

        async def whole_capacity():
            engine.add_request([5, 6], SamplingParams(max_tokens=1, n=4), client="D")

        asyncio.run(whole_capacity())
    finally:
        engine.shutdown()
