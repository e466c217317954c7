"""Fault injection inside a forward (the test hook `EngineCore.inject_fault` marks `Sequence.fault`)."""

from __future__ import annotations

from engine.scheduler import ScheduledChunk


class RequestFault(RuntimeError):
    """Raised by the test hook inside a forward; names the one sequence that must fail."""

    def __init__(self, seq_id: str):
        super().__init__(f"injected fault in the forward of {seq_id}")
        self.seq_id = seq_id


def raise_injected_faults(plan: list[ScheduledChunk]) -> None:
    """Raise `RequestFault` for the first sequence of `plan` marked to fail (both runners call it first)."""
    for chunk in plan:
        if chunk.seq.fault:
            raise RequestFault(chunk.seq.seq_id)
