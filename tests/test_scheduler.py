"""Scheduler and block allocator without a model: budgets, fairness, preemption, no leaks."""

import random

from engine.kv_cache import BlockAllocator
from engine.request import RequestStatus, SamplingParams, Sequence
from engine.scheduler import Scheduler


def seq(name: str, prompt_len: int, max_tokens: int = 8) -> Sequence:
    return Sequence(seq_id=name, request_id=name, index=0, token_ids=list(range(prompt_len)),
                    num_prompt_tokens=prompt_len, params=SamplingParams(max_tokens=max_tokens))


def run_plan(plan) -> None:
    """What the engine does after a forward: advance, and append a token where one is sampled."""
    for chunk in plan:
        chunk.seq.num_computed_tokens += chunk.num_tokens
        if chunk.samples:
            chunk.seq.token_ids.append(7)


def test_allocator_grows_and_frees():
    alloc = BlockAllocator(num_blocks=4, block_size=4)
    table: list[int] = []
    assert alloc.allocate(table, 5) and len(table) == 2
    assert alloc.allocate(table, 8) and len(table) == 2  # still fits
    assert not alloc.allocate(table, 17)  # needs 5 blocks of 4
    assert len(table) == 2 and alloc.num_free == 2  # a failed allocation changes nothing
    assert alloc.usage == 0.5
    alloc.free(table)
    assert table == [] and alloc.num_free == 4 and alloc.usage == 0.0


def test_token_budget_and_chunked_prefill():
    sched = Scheduler(BlockAllocator(100, 16), max_num_seqs=8, max_num_batched_tokens=64)
    long, short = seq("long", 150), seq("short", 10)
    sched.add(long)
    sched.add(short)
    plan = sched.schedule()
    assert [(c.seq.seq_id, c.num_tokens) for c in plan] == [("long", 64)]  # budget spent on the first
    run_plan(plan)
    plan = sched.schedule()
    assert [(c.seq.seq_id, c.num_tokens) for c in plan] == [("long", 64)]
    run_plan(plan)
    plan = sched.schedule()  # 22 prompt tokens left of long; short admitted with the rest
    assert [(c.seq.seq_id, c.num_tokens, c.samples) for c in plan] == [("long", 22, True), ("short", 10, True)]
    run_plan(plan)
    plan = sched.schedule()  # both decode now: one token each
    assert [(c.seq.seq_id, c.num_tokens) for c in plan] == [("long", 1), ("short", 1)]
    assert sum(c.num_tokens for c in plan) <= 64


def test_decodes_are_not_stalled_by_a_long_prompt():
    sched = Scheduler(BlockAllocator(200, 16), max_num_seqs=8, max_num_batched_tokens=32)
    a = seq("a", 4)
    sched.add(a)
    run_plan(sched.schedule())
    sched.add(seq("long", 500))
    for _ in range(5):  # every step, a decodes while the long prompt is fed in chunks
        plan = sched.schedule()
        assert plan[0].seq is a and plan[0].num_tokens == 1
        assert plan[1].seq.seq_id == "long" and plan[1].num_tokens == 31
        run_plan(plan)


def test_max_num_seqs_and_fifo():
    sched = Scheduler(BlockAllocator(100, 16), max_num_seqs=2, max_num_batched_tokens=1000)
    seqs = [seq(f"s{i}", 5) for i in range(4)]
    for s in seqs:
        sched.add(s)
    plan = sched.schedule()
    assert [c.seq.seq_id for c in plan] == ["s0", "s1"]
    assert [s.seq_id for s in sched.waiting] == ["s2", "s3"]
    sched.finish(seqs[0])
    run_plan(plan)
    plan = sched.schedule()
    assert [c.seq.seq_id for c in plan] == ["s1", "s2"]  # s2 before s3


def test_preemption_frees_blocks_and_requeues_first():
    sched = Scheduler(BlockAllocator(4, 4), max_num_seqs=8, max_num_batched_tokens=100)
    a, b = seq("a", 8), seq("b", 8)  # 2 blocks each: the pool is full
    sched.add(a)
    sched.add(b)
    run_plan(sched.schedule())
    assert sched.allocator.num_free == 0
    plan = sched.schedule()  # a needs a 3rd block for its 9th token: b (the newest) is preempted
    assert [c.seq.seq_id for c in plan] == ["a"]
    assert sched.num_preemptions == 1 and b.status is RequestStatus.WAITING
    assert b.num_computed_tokens == 0 and b.block_table == [] and sched.waiting[0] is b
    assert len(b.token_ids) == 9  # its sampled token is kept and will be recomputed


def test_no_block_leaks_after_random_operations():
    rng = random.Random(1)
    alloc = BlockAllocator(24, 4)
    sched = Scheduler(alloc, max_num_seqs=6, max_num_batched_tokens=48)
    live: list[Sequence] = []
    for i in range(1000):
        op = rng.random()
        if op < 0.4:
            s = seq(f"s{i}", rng.randint(1, 40))
            sched.add(s)
            live.append(s)
        elif op < 0.6 and live:  # abort, wherever it is
            s = live.pop(rng.randrange(len(live)))
            sched.finish(s)
        else:
            plan = sched.schedule()
            budget = sum(c.num_tokens for c in plan)
            assert budget <= 48 and len(sched.running) <= 6
            run_plan(plan)
            for c in plan:  # finish some that reached their length
                if c.seq.num_output_tokens >= 12 and c.seq in live:
                    live.remove(c.seq)
                    sched.finish(c.seq)
        held = sum(len(s.block_table) for s in sched.running) + sum(len(s.block_table) for s in sched.waiting)
        assert held + alloc.num_free == 24  # every block is either held or free, never both, never lost
    for s in live:
        sched.finish(s)
    assert alloc.num_free == 24 and not sched.running and not sched.waiting
    assert sched.num_preemptions > 0  # the run did exercise preemption


# ---- prefix caching ------------------------------------------------------------------------


def run_plan_caching(alloc: BlockAllocator, plan) -> None:
    """run_plan, plus naming the blocks that got full, as EngineCore.step does."""
    for chunk in plan:
        s = chunk.seq
        s.num_computed_tokens += chunk.num_tokens
        s.num_cached_blocks = alloc.cache_full_blocks(s.token_ids, s.block_hashes, s.block_table,
                                                      s.num_computed_tokens, s.num_cached_blocks)
        if chunk.samples:
            s.token_ids.append(7)


def test_prefix_cache_shares_full_blocks_of_a_common_prefix():
    alloc = BlockAllocator(16, 4, prefix_caching=True)
    sched = Scheduler(alloc, max_num_seqs=8, max_num_batched_tokens=100)
    first = Sequence("a", "a", 0, list(range(10)) + [50, 51], 12, SamplingParams(max_tokens=4))
    sched.add(first)
    run_plan_caching(alloc, sched.schedule())
    assert first.num_cached_blocks == 3  # 12 tokens computed: three full blocks named
    # same first 10 tokens, then different: blocks 0-1 (tokens 0..7) are shared, block 2 differs
    second = Sequence("b", "b", 0, list(range(10)) + [60, 61, 62], 13, SamplingParams(max_tokens=4))
    sched.add(second)
    plan = sched.schedule()
    chunk = next(c for c in plan if c.seq is second)
    assert chunk.start == 8 and chunk.num_tokens == 5  # only the tokens after the shared blocks run
    assert second.block_table[:2] == first.block_table[:2] and second.block_table[2] != first.block_table[2]
    assert alloc.refs[first.block_table[0]] == 2
    assert (alloc.hit_tokens, alloc.queried_tokens) == (8, 25)
    # a prompt that is all cached still computes its last token (its logits pick the next one)
    third = Sequence("c", "c", 0, list(range(8)), 8, SamplingParams(max_tokens=4))
    sched.add(third)
    chunk = next(c for c in sched.schedule() if c.seq is third)
    assert (chunk.start, chunk.num_tokens) == (4, 4)


def test_prefix_cache_keeps_freed_blocks_until_they_are_needed():
    alloc = BlockAllocator(4, 4, prefix_caching=True)
    table, hashes = [], []
    tokens = list(range(16))
    assert alloc.allocate(table, 16)
    alloc.cache_full_blocks(tokens, hashes, table, 16, 0)
    kept = list(table)
    alloc.free(table)
    assert alloc.num_free == 4 and len(alloc.evictable) == 4  # cached, unused: free, but still named
    again: list[int] = []
    assert alloc.match_prefix(tokens + [99], [], again) == 16 and again == kept
    alloc.free(again)
    other: list[int] = []
    assert alloc.allocate(other, 8)  # no never-cached block left: the two freed longest ago are evicted
    assert alloc.num_free == 2 and len(alloc.cached) == 2
    assert alloc.match_prefix(tokens + [99], [], []) == 8  # the head of the chain survived, the tail was evicted first


def test_prefix_cache_no_leaks_and_no_shared_writes_after_random_operations():
    """Prompts drawn from a few shared prefixes; blocks are shared, freed, evicted and reused
    1,000 times: every block is held or free (never lost), a shared block is never handed out
    again while held, and no sequence ever computes into a block someone else holds."""
    rng = random.Random(2)
    alloc = BlockAllocator(32, 4, prefix_caching=True)
    sched = Scheduler(alloc, max_num_seqs=6, max_num_batched_tokens=40)
    prefixes = [[rng.randrange(100) for _ in range(rng.randint(4, 20))] for _ in range(4)]
    live: list[Sequence] = []
    for i in range(1000):
        op = rng.random()
        if op < 0.4:
            tokens = rng.choice(prefixes) + [rng.randrange(100) for _ in range(rng.randint(1, 10))]
            s = Sequence(f"s{i}", f"s{i}", 0, tokens, len(tokens), SamplingParams(max_tokens=12))
            sched.add(s)
            live.append(s)
        elif op < 0.55 and live:
            sched.finish(live.pop(rng.randrange(len(live))))
        else:
            plan = sched.schedule()
            for c in plan:  # the blocks this chunk writes are this sequence's alone
                bs = alloc.block_size
                for b in c.seq.block_table[c.start // bs:(c.start + c.num_tokens - 1) // bs + 1]:
                    assert alloc.refs[b] == 1
            run_plan_caching(alloc, plan)
            for c in plan:
                if c.seq.num_output_tokens >= 12 and c.seq in live:
                    live.remove(c.seq)
                    sched.finish(c.seq)
        holders: dict[int, int] = {}
        for s in [*sched.running, *sched.waiting]:
            for b in s.block_table:
                holders[b] = holders.get(b, 0) + 1
        assert all(alloc.refs[b] == n for b, n in holders.items())
        assert len(holders) + alloc.num_free == 32
        assert not set(holders) & (set(alloc.free_blocks) | set(alloc.evictable))
    for s in live:
        sched.finish(s)
    assert alloc.num_free == 32 and sum(alloc.refs) == 0
    assert alloc.hit_tokens > 0 and sched.num_preemptions > 0



def test_a_step_that_preempts_admits_nobody():
    """The victim goes to the head of the queue; were it admitted in the same step (a short chunk
    fits the blocks it just gave up), the next block boundary would preempt it again: thrashing."""
    sched = Scheduler(BlockAllocator(4, 4), max_num_seqs=8, max_num_batched_tokens=5)
    a, c = seq("a", 8), seq("c", 8)
    sched.add(a)
    sched.add(c)
    run_plan(sched.schedule())  # a: 5 prompt tokens (2 blocks); the budget is spent
    plan = sched.schedule()  # a: the last 3 and a sample; c: a 2-token chunk (1 block)
    assert [(ch.seq.seq_id, ch.num_tokens) for ch in plan] == [("a", 3), ("c", 2)]
    run_plan(plan)
    assert sched.allocator.num_free == 1
    plan = sched.schedule()  # a takes the last block for its 9th token; c cannot grow: preempted
    assert sched.num_preemptions == 1 and c.status is RequestStatus.WAITING and c.block_table == []
    assert [(ch.seq.seq_id, ch.num_tokens) for ch in plan] == [("a", 1)]  # and not admitted again now
    assert sched.allocator.num_free == 1 and list(sched.waiting) == [c]
    run_plan(plan)
    plan = sched.schedule()  # the next step admits it as usual
    assert [ch.seq.seq_id for ch in plan] == ["a", "c"] and c.status is RequestStatus.RUNNING


def test_a_prompt_waits_for_the_prefix_blocks_a_running_prompt_is_computing():
    # Two prompts with one 8-token system prefix arrive together: the second waits one step for
    # the first to compute and name the shared blocks, then computes only its own tokens, while a
    # prompt behind it that shares nothing is admitted at once.
    alloc = BlockAllocator(32, 4, prefix_caching=True)
    sched = Scheduler(alloc, max_num_seqs=8, max_num_batched_tokens=100)
    system = list(range(100, 108))
    first = Sequence("a", "a", 0, system + [1, 2, 3], 11, SamplingParams(max_tokens=4))
    second = Sequence("b", "b", 0, system + [4, 5, 6, 7, 8], 13, SamplingParams(max_tokens=4))
    other = Sequence("c", "c", 0, list(range(6)), 6, SamplingParams(max_tokens=4))
    for s in (first, second, other):
        sched.add(s)
    plan = sched.schedule()
    assert [(c.seq.seq_id, c.start, c.num_tokens) for c in plan] == [("a", 0, 11), ("c", 0, 6)]
    assert list(sched.waiting) == [second] and second.block_table == [] and second.num_computed_tokens == 0
    run_plan_caching(alloc, plan)
    plan = sched.schedule()
    chunk = next(c for c in plan if c.seq is second)
    assert (chunk.start, chunk.num_tokens) == (8, 5)  # the system prompt's two blocks came from the cache
    assert second.block_table[:2] == first.block_table[:2]
    # a waiting prompt whose prefix owner went away is not held for it
    alloc2 = BlockAllocator(32, 4, prefix_caching=True)
    sched2 = Scheduler(alloc2, max_num_seqs=8, max_num_batched_tokens=100)
    owner = Sequence("d", "d", 0, system + [1], 9, SamplingParams(max_tokens=4))
    follower = Sequence("e", "e", 0, system + [2], 9, SamplingParams(max_tokens=4))
    sched2.add(owner)
    sched2.add(follower)
    assert [c.seq for c in sched2.schedule()] == [owner]
    sched2.finish(owner)  # aborted before its blocks were named
    assert [(c.seq, c.start) for c in sched2.schedule()] == [(follower, 0)]
