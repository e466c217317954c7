"""Iteration-level scheduling under a token budget, with chunked prefill and preemption.

Plain Python. Each step, running sequences go first (FIFO), each asking for the tokens it
has not computed yet (one for a decode, a chunk of its prompt otherwise); then waiting
sequences are admitted while the budget, `max_num_seqs` and free KV blocks allow; a waiting
sequence first takes the cached blocks of its longest known prefix (`BlockAllocator.match_prefix`)
and only computes the rest; one whose next block a running sequence is computing right now
waits for it (the others behind it go on). Between clients the next waiting sequence is the
first of the client with the smallest virtual token counter (engine/fair_share.py); with one
client that is plain FIFO. When a running sequence cannot get a block, the most recently
admitted one is preempted: its blocks are freed and it goes back to the front of the queue to
be recomputed later. A step that preempted admits nobody: the free blocks it left would go to the
waiting queue's head (often the victim itself), only to be taken back the next step (thrashing).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass

from engine.fair_share import VirtualTokenCounter
from engine.kv_cache import BlockAllocator
from engine.request import RequestStatus, Sequence


@dataclass(slots=True)
class ScheduledChunk:
    """`num_tokens` tokens of `seq`, starting at position `start`, go through this forward."""

    seq: Sequence
    start: int
    num_tokens: int  # the draft's tokens included
    draft: tuple[int, ...] = ()  # guessed tokens after the sequence's last one, verified by this forward (engine/speculative.py)

    @property
    def samples(self) -> bool:
        """This chunk reaches the end of the sequence's tokens, so a new token is sampled (a token
        for each of its draft's positions too)."""
        return self.start + self.num_tokens - len(self.draft) == len(self.seq.token_ids)

    @property
    def token_ids(self) -> list[int]:
        """The tokens this chunk runs: the sequence's, then the draft's."""
        end = self.start + self.num_tokens - len(self.draft)
        return self.seq.token_ids[self.start:end] + list(self.draft) if self.draft else self.seq.token_ids[self.start:end]


class Scheduler:
    """Waiting and running queues over one BlockAllocator."""

    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_num_batched_tokens: int):
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0
        self.fair = VirtualTokenCounter()  # which client's waiting sequence goes next

    def add(self, seq: Sequence) -> None:
        seq.status = RequestStatus.WAITING
        self.waiting.append(seq)
        self.fair.activate(seq.client)
        self.fair.queued(seq.client)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        plan: list[ScheduledChunk] = []
        scheduled: set[int] = set()
        self._make_room_for_a_waiting_client()
        num_preemptions = self.num_preemptions
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            if seq.images is not None:  # an image that must stay whole is never cut (Gemma 3)
                num_new = seq.images.chunk_tokens(seq.num_computed_tokens, num_new)
            draft = self._draft(seq, num_new, budget)
            num_new += len(draft)
            # Make room, preempting from the back; the sequence itself may be the victim.
            while not self.allocator.allocate(seq.block_table, seq.num_computed_tokens + num_new):
                victim = self.running[-1]
                if id(victim) in scheduled:  # never preempt what this step already runs
                    victim = seq
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                plan.append(ScheduledChunk(seq, seq.num_computed_tokens, num_new, draft))
                self.fair.charge(seq.client, num_new)
                scheduled.add(id(seq))
                budget -= num_new
                i += 1
                continue
            # seq was preempted: running shrank, the same index now holds the next one
        if self.num_preemptions != num_preemptions:
            return plan  # memory ran short this step: admitting now would take the victim's blocks again
        in_flight = self._in_flight() if self.allocator.prefix_caching and self.waiting else set()
        held: list[Sequence] = []  # waiting for prompt blocks that a running sequence computes now
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            index = self.fair.pick(self.waiting)
            seq = self.waiting[index]
            looked_up = seq.num_computed_tokens == 0
            if looked_up:  # reuse the cached blocks of a known prefix
                seq.num_computed_tokens = self.allocator.match_prefix(seq.token_ids, seq.block_hashes, seq.block_table,
                                                                       seq.params.cache_salt, seq.images)
                matched = len(seq.block_table)
                if matched < len(seq.block_hashes) and seq.block_hashes[matched] in in_flight:
                    self.allocator.free(seq.block_table)  # it takes them, and the ones on the way, later
                    seq.num_computed_tokens = 0
                    del self.waiting[index]
                    held.append(seq)  # still counted as waiting by self.fair
                    continue
            num_new = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            if seq.images is not None:
                num_new = seq.images.chunk_tokens(seq.num_computed_tokens, num_new)
            if not self.allocator.allocate(seq.block_table, seq.num_computed_tokens + num_new):
                self.allocator.free(seq.block_table)  # it waits holding nothing
                seq.num_computed_tokens = 0
                break  # nobody jumps the queue past the one whose turn it is
            if looked_up:
                self.allocator.count_lookup(len(seq.token_ids), seq.num_computed_tokens)
            del self.waiting[index]
            self.fair.unqueued(seq.client)
            seq.status = RequestStatus.RUNNING
            if seq.scheduled_time is None:
                seq.scheduled_time = time.monotonic()
            self.running.append(seq)
            plan.append(ScheduledChunk(seq, seq.num_computed_tokens, num_new))
            self.fair.charge(seq.client, num_new)
            budget -= num_new
            if self.allocator.prefix_caching:  # its prompt blocks from here on are on the way too
                in_flight.update(self._uncomputed_hashes(seq))
        self.waiting.extendleft(reversed(held))
        return plan

    def _make_room_for_a_waiting_client(self) -> None:
        """All slots taken and a client waiting with nothing running: the client running the most
        beyond its share of the slots gives one up (its most recently admitted sequence, preempted
        and recomputed later), which the waiting client's lower counter then takes this step.
        Otherwise a newcomer would wait for a flood's running sequences to finish (whole answers)."""
        if len(self.running) < self.max_num_seqs or len(self.fair.active) < 2 or not self.fair.waiting:
            return
        running_by = Counter(s.client for s in self.running)
        if all(client in running_by for client in self.fair.waiting):
            return
        client, held = running_by.most_common(1)[0]
        if held > self.max_num_seqs / len(running_by.keys() | self.fair.waiting.keys()):
            self._preempt(next(s for s in reversed(self.running) if s.client == client))

    def _draft(self, seq: Sequence, num_new: int, budget: int) -> tuple[int, ...]:
        """The draft a decode-ready sequence verifies this step: what fits the budget and the free
        blocks (a draft never preempts anyone: without room it waits for a later step)."""
        draft = seq.draft_token_ids[:budget - 1] if num_new == 1 else ()
        if draft and not self.allocator.allocate(seq.block_table, seq.num_computed_tokens + 1 + len(draft)):
            return ()
        return tuple(draft)

    def _in_flight(self) -> set[bytes]:
        """Hashes of the full prompt blocks that running sequences are still computing. A waiting
        sequence whose next block after its cached prefix is one of them waits for it instead of
        computing the same tokens again: 32 requests with one system prompt arriving together
        would otherwise each compute it in their first steps, before any of them has cached it."""
        return {h for s in self.running if s.num_computed_tokens < s.num_prompt_tokens
                for h in self._uncomputed_hashes(s)}

    def _uncomputed_hashes(self, seq: Sequence) -> list[bytes]:
        """The hashes of `seq`'s full prompt blocks from the one its next token goes into."""
        return seq.block_hashes[seq.num_computed_tokens // self.allocator.block_size:]

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.allocator.free(seq.block_table)
        seq.num_computed_tokens = seq.num_cached_blocks = 0
        seq.num_preemptions += 1
        seq.status = RequestStatus.WAITING
        self.waiting.appendleft(seq)
        self.fair.queued(seq.client)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence from either queue and free its blocks."""
        if seq.status is RequestStatus.RUNNING:
            self.running.remove(seq)
            self.fair.deactivate(seq.client)
        elif seq.status is RequestStatus.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
            else:
                self.fair.unqueued(seq.client)
            self.fair.deactivate(seq.client)
        self.allocator.free(seq.block_table)
        seq.num_cached_blocks = 0
        seq.status = RequestStatus.FINISHED
