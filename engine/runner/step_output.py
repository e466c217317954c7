"""`StepOutput`: what a forward hands the sampler."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class StepOutput:
    """The logits of a step's sampling rows, and what the step already found about them."""

    logits: torch.Tensor  # [sampling rows, vocab] float32, in plan order (int8-kernel logits when screened)
    # [sampling rows] int64 on the CPU: each row's first largest logit, -1 where a logit is not finite
    # (the native step's head, a GPU's step of argmax-only rows); None: not computed
    argmax: torch.Tensor | None = None
    screened: bool = False  # only the argmax is exact: the native step screened a Q8_0 head (engine/runner/native.py)

    @classmethod
    def of(cls, value: StepOutput | torch.Tensor) -> StepOutput:
        """`value` as a StepOutput: bare logits (a test's stand-in runner, a sampler's caller) found nothing else."""
        return value if isinstance(value, StepOutput) else cls(value)

    def rows(self, index) -> StepOutput:
        """The rows `index` (a list of row numbers or a slice), with their argmax."""
        return StepOutput(self.logits[index], None if self.argmax is None else self.argmax[index], self.screened)

    @staticmethod
    def cat(parts: list[StepOutput]) -> StepOutput:
        """The rows of `parts` one after another; the argmax only when every part has one."""
        argmax = None
        if all(p.argmax is not None for p in parts):
            argmax = torch.cat([p.argmax for p in parts])
        return StepOutput(torch.cat([p.logits for p in parts]), argmax, any(p.screened for p in parts))

    def clone(self) -> torch.Tensor:
        """A copy of the logits alone, to change: what the step found about them does not hold for a copy."""
        return self.logits.clone()
