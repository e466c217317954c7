"""`FallbackRunner`: one forward per sequence, for models whose layers do not call transformers'
attention interface (Bloom, Falcon, remote code): correct but unbatched."""

from __future__ import annotations

import torch

from engine.runner.faults import raise_injected_faults
from engine.runner.step_output import StepOutput
from engine.scheduler import ScheduledChunk


def _truncate(cache, length: int) -> None:
    """Cut every layer of a `DynamicCache` back to `length` tokens (a failed forward may have
    appended to some layers only)."""
    for layer in cache.layers:
        extra = layer.get_seq_length() - length
        if extra > 0:
            layer.crop(-extra)


class FallbackRunner:
    """One forward per sequence with a `DynamicCache` kept per sequence (models without the interface)."""

    path = "fallback"

    def __init__(self, model):
        self.model = model
        self.caches: dict[str, object] = {}

    @torch.inference_mode()
    def run(self, plan: list[ScheduledChunk]) -> StepOutput:
        """float32 logits [num_sampling_chunks, vocab] in plan order, one forward per chunk."""
        from transformers import DynamicCache

        raise_injected_faults(plan)
        rows = []
        for done, chunk in enumerate(plan):
            seq, start, n = chunk.seq, chunk.start, chunk.num_tokens
            if start == 0:
                self.caches[seq.seq_id] = DynamicCache(config=self.model.config)
            cache = self.caches[seq.seq_id]
            end = start + n
            try:
                out = self.model(
                    input_ids=torch.tensor([seq.token_ids[start:end]], device=self.model.device),
                    attention_mask=torch.ones(1, end, dtype=torch.long, device=self.model.device),
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
            except Exception:  # roll back what this run appended, so that a retry starts clean
                for ran in plan[:done + 1]:
                    _truncate(self.caches[ran.seq.seq_id], ran.start)
                raise
            if chunk.samples:
                rows.append(out.logits[0, -1].float())
        if not rows:
            return StepOutput(torch.empty(0, 0))
        return StepOutput(torch.stack(rows))

    def free(self, seq_id: str) -> None:
        self.caches.pop(seq_id, None)
