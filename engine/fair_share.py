"""Fair shares between clients: who gets past a full queue, and who is scheduled next.

Plain Python. A client is whatever key the front end names it by (a page session, a caller's
address: never a name the caller chooses, or rotating names would multiply its share); `None` is
one anonymous client, so the Python API without clients behaves as a single client: first come,
first served, the queue's bound as before.

- `AdmissionShares` (the 429): past `capacity` admitted sequences, a client is still admitted while
  it holds less than its fair share, `capacity` divided by the clients holding sequences (the
  newcomer counted), up to `hard_cap` sequences in all so memory stays bounded.
- `VirtualTokenCounter` (the order): each client's counter grows by the tokens computed for it
  (prompt chunks, decodes, drafts); the next waiting sequence is the first of the client with the
  smallest counter, FIFO within a client and between equal counters. A client that becomes active
  again is lifted to the smallest counter of the active clients, so idle time earns no credit
  ("Fairness in Serving Large Language Models", Sheng et al., OSDI 2024).
"""

from __future__ import annotations

from collections import Counter, deque

MAX_IDLE_COUNTERS = 4096  # inactive clients' counters kept before those that earn nothing are dropped


class AdmissionShares:
    """Admitted sequences per client, and the rule that refuses a client at or over its share.
    Not thread-safe: the caller holds its lock."""

    def __init__(self):
        self.held: Counter = Counter()  # client -> sequences admitted and not finished
        self.total = 0
        self._client_of: dict[str, object] = {}  # request id -> its client

    def admits(self, client, n: int, capacity: int, hard_cap: int) -> bool:
        """Whether `n` more sequences of `client` fit: within `capacity` anyone's do; past it, a
        client's whose holding stays within its fair share (and all within `hard_cap`)."""
        if self.total + n <= capacity:
            return True
        if self.total + n > hard_cap:
            return False
        clients = len(self.held) + (client not in self.held)
        return self.held[client] + n <= capacity / clients

    def why_not(self, client, capacity: int) -> str:
        """What a refusal adds when other clients hold sequences: this one's holding and share."""
        clients = len(self.held) + (client not in self.held)
        if clients == 1:
            return ""
        return (f", and this client holds {self.held[client]} of them, its fair share being "
                f"{capacity / clients:g} with {clients} clients")

    def add(self, request_id: str, client, n: int) -> None:
        self._client_of[request_id] = client
        self.held[client] += n
        self.total += n

    def release(self, request_id: str, last: bool) -> None:
        """One sequence of `request_id` finished (`last`: its request has none left)."""
        client = self._client_of[request_id] if not last else self._client_of.pop(request_id)
        self.total -= 1
        self.held[client] -= 1
        if self.held[client] <= 0:
            del self.held[client]

    def clear(self) -> None:
        self.held.clear()
        self._client_of.clear()
        self.total = 0


class VirtualTokenCounter:
    """Per-client virtual token counters over the scheduler's queues (see the module doc)."""

    def __init__(self):
        self.counters: dict[object, int] = {}  # client -> tokens computed for it (lifted on return)
        self.active: Counter = Counter()  # client -> its sequences in the scheduler (waiting or running)
        self.waiting: Counter = Counter()  # client -> its sequences waiting (never fewer than in the queue)

    def activate(self, client) -> None:
        """A sequence of `client` enters the scheduler; a client returning from idle is lifted."""
        if not self.active[client]:
            floor = min((self.counters.get(c, 0) for c in self.active), default=None)
            if floor is not None:
                self.counters[client] = max(self.counters.get(client, 0), floor)
                if len(self.counters) > MAX_IDLE_COUNTERS:
                    self._forget_idle(floor)
        self.active[client] += 1

    def deactivate(self, client) -> None:
        """A sequence of `client` leaves the scheduler (finished or aborted)."""
        self.active[client] -= 1
        if self.active[client] <= 0:
            del self.active[client]
            if not self.active:  # idle: every counter would be lifted to the next arrival's anyway
                self.counters.clear()

    def _forget_idle(self, floor: int) -> None:
        """Drops the counters of inactive clients at or below `floor` (the smallest active counter,
        which never decreases while anyone is active): they would be lifted to it on return anyway."""
        for client in [c for c, v in self.counters.items() if v <= floor and c not in self.active]:
            del self.counters[client]

    def queued(self, client) -> None:
        self.waiting[client] += 1

    def unqueued(self, client) -> None:
        self.waiting[client] -= 1
        if self.waiting[client] <= 0:
            del self.waiting[client]

    def charge(self, client, num_tokens: int) -> None:
        """`num_tokens` are computed for `client` in this step (a prompt chunk, a decode, a draft)."""
        self.counters[client] = self.counters.get(client, 0) + num_tokens

    def pick(self, waiting: deque) -> int:
        """The index in `waiting` of the sequence to admit next: the first of the client with the
        smallest counter (ties: the earliest in the queue). With one client waiting: index 0."""
        if len(self.waiting) <= 1:
            return 0
        best, best_index, seen = None, 0, set()
        for index, seq in enumerate(waiting):
            if seq.client in seen:
                continue
            seen.add(seq.client)
            counter = self.counters.get(seq.client, 0)
            if best is None or counter < best:
                best, best_index = counter, index
            if len(seen) == len(self.waiting):
                break
        return best_index
