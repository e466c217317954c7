"""Ray Serve's request-router hook for rill: a conversation goes back to the replica whose
prefix cache holds its earlier turns.

The router runs in the front end's process (inside the `DeploymentHandle`), sees each call's
arguments, and ranks the replicas: first the one that owns the request (by its session key,
`x-session-id`, else by the longest run of full KV blocks of its prompt that an earlier request
sent somewhere), then all the others, where Ray Serve takes the least loaded one that is not
full. A second turn's prompt starts with the first turn's prompt, so its blocks find the
replica that computed them, with no key from the client. Affinity gives way to load: when the
owner runs `imbalance` more requests than the least loaded replica, or is full, the request goes
elsewhere (and that replica owns the conversation from then on).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_KEYS = 65536  # session keys and block hashes remembered (least recently used dropped first)
DEFAULT_IMBALANCE = 8
MIN_PREFIX_BLOCKS = 2  # a shorter shared prefix saves too little to outweigh balancing the load


def prompt_block_keys(prompt_token_ids: list[int], block_size: int) -> list[int]:
    """One key per full block of the prompt, each chained to the ones before it (so a key names
    the whole prefix up to its block, as the engine's prefix cache does)."""
    keys, key = [], 0
    for start in range(0, len(prompt_token_ids) - block_size + 1, block_size):
        key = hash((key, tuple(prompt_token_ids[start:start + block_size])))
        keys.append(key)
    return keys


class PrefixAffinityRouter(RequestRouter):
    """Session and prompt-prefix affinity, bounded by load (see the module docstring)."""

    def initialize_state(self, block_size: int = DEFAULT_BLOCK_SIZE, max_keys: int = DEFAULT_MAX_KEYS,
                         imbalance: int = DEFAULT_IMBALANCE, **kwargs) -> None:
        self._block_size = int(block_size)
        self._max_keys = int(max_keys)
        self._imbalance = int(imbalance)
        self._owners: OrderedDict = OrderedDict()  # session key or block key -> ReplicaID
        self.affinity_hits = 0  # requests sent to the replica that owned them (for tests and logs)

    def _keys(self, pending_request: PendingRequest) -> tuple[object | None, list[int]]:
        session = pending_request.metadata.session_id or None
        prompt = pending_request.kwargs.get("prompt_token_ids") or []
        return (("session", session) if session else None), prompt_block_keys(prompt, self._block_size)

    def _owner(self, pending_request: PendingRequest) -> ReplicaID | None:
        """The session's replica, else the one that got the longest known prefix of the prompt when
        that prefix is worth following: at least MIN_PREFIX_BLOCKS blocks and half the prompt (a
        chat template's opening words, shared by every request, are not)."""
        session_key, block_keys = self._keys(pending_request)
        owner = self._owners.get(session_key) if session_key else None
        if owner is not None and owner in self._replicas:
            return owner
        for depth in range(len(block_keys), 0, -1):  # the longest prefix first
            if depth < MIN_PREFIX_BLOCKS or 2 * depth < len(block_keys):
                return None
            owner = self._owners.get(block_keys[depth - 1])
            if owner is not None and owner in self._replicas:
                return owner
        return None

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if pending_request is None or not candidate_replicas:
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True  # all full: wait a little between tries
        owner = self._owner(pending_request)
        if owner is None:
            return [candidate_replicas]
        others = [r for r in candidate_replicas if r.replica_id != owner]
        cache = self._replica_queue_len_cache  # requests each replica runs, as last seen (None: not yet)
        if others and (cache.get(owner) or 0) > min(cache.get(r.replica_id) or 0 for r in others) + self._imbalance:
            return [candidate_replicas]
        self.affinity_hits += 1
        return [[self._replicas[owner]], others] if others else [[self._replicas[owner]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        session_key, block_keys = self._keys(pending_request)
        for key in ([session_key] if session_key else []) + block_keys:
            self._owners[key] = replica_id
            self._owners.move_to_end(key)
        while len(self._owners) > self._max_keys:
            self._owners.popitem(last=False)
