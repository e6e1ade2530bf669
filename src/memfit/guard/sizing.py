"""Which micro-batch size the guard uses next: halve after an OOM, maybe grow back after clean steps.

The policy only *proposes* sizes; under ``torch.distributed`` every rank proposes and the smallest proposal is
agreed (``memfit.guard.agreement``), so a rank's local view (its input shape, its measured headroom) can only
make the agreed size smaller, never make the ranks disagree.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from memfit.guard.rollback import resolve_device

logger = logging.getLogger(__name__)

UNBOUNDED = 2**62  # "the whole batch", as an int64 on the wire
ShapeKey = tuple[tuple[int, ...], ...]

# Grow only when the predicted peak at double the micro-batch stays below this share of the limit: the linear
# prediction ignores fragmentation and library workspaces, so leave a margin (a judgement, not a measurement).
GROW_HEADROOM = 0.85


class MicroBatchSizer:
    """The adaptive micro-batch size and what it learned: sizes that ran out of memory, per input shape.

    Args:
        start: Size to start with; None means the whole batch.
        grow_after: Clean steps before proposing to double; None never grows.
        device: Where the step runs; headroom is measured only on CUDA.
    """

    def __init__(self, start: int | None, grow_after: int | None, device: torch.device) -> None:
        self.size = start
        self.grow_after = grow_after
        self.device = resolve_device(device)  # CUDA calls below get an index, never a bare "cuda"
        self.failed: dict[ShapeKey, int] = {}
        self.clean_steps = 0

    @property
    def measures_headroom(self) -> bool:
        """Whether each step must record its peak (it resets CUDA peak statistics)."""
        return self.grow_after is not None and self.device.type == "cuda"

    def size_for(self, batch_size: int) -> int:
        """Samples per micro-batch for a batch of ``batch_size`` samples."""
        return min(self.size or batch_size, batch_size)

    def shrink_proposal(self, key: ShapeKey, size: int) -> int:
        """Remember that ``size`` failed for ``key``; propose half (0 when it was already 1)."""
        self.failed[key] = min(self.failed.get(key, UNBOUNDED), size)
        self.clean_steps = 0
        return size // 2

    def keep_or_grow_proposal(self, key: ShapeKey, size: int, batch_size: int, baseline_bytes: int | None) -> int:
        """After a successful attempt: the current size, or double it when that is allowed and seems to fit."""
        if self.size is None:
            return UNBOUNDED
        if self.grow_after is None or self.clean_steps + 1 < self.grow_after:
            return self.size
        candidate = self.size * 2
        if candidate >= self.failed.get(key, UNBOUNDED):
            return self.size  # that size (or a smaller one) ran out of memory for this input shape
        if size < batch_size and baseline_bytes is not None and not self._fits(size, candidate, baseline_bytes):
            return self.size
        return candidate

    def _fits(self, size: int, candidate: int, baseline_bytes: int) -> bool:
        # Activations scale with the micro-batch: peak(candidate) ~ baseline + (peak - baseline) * ratio.
        # Conservative: gradients are in (peak - baseline) but do not grow with the micro-batch.
        index = self.device.index
        peak_bytes = torch.cuda.max_memory_allocated(index)
        predicted_bytes = baseline_bytes + (peak_bytes - baseline_bytes) * candidate / size
        free_bytes, total_bytes = torch.cuda.mem_get_info(index)
        limit_bytes = free_bytes + torch.cuda.memory_reserved(index)
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.6
        if fraction is not None:
            limit_bytes = min(limit_bytes, int(fraction(index) * total_bytes))
        return predicted_bytes <= GROW_HEADROOM * limit_bytes

    def apply_shrink(self, agreed: int) -> None:
        self.size = agreed

    def apply_success(self, agreed: int) -> None:
        """Count a clean step and adopt the agreed proposal if it is larger."""
        self.clean_steps += 1
        if self.size is not None and agreed > self.size:
            logger.info("%d steps without OOM; micro-batch size %d -> %d",
                        self.clean_steps, self.size, agreed)
            self.size = agreed
            self.clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "micro_batch_size": self.size,
            "failed_sizes": [[[list(s) for s in key], size] for key, size in self.failed.items()],
            "clean_steps": self.clean_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.size = state["micro_batch_size"]
        self.failed = {tuple(tuple(s) for s in key): int(size) for key, size in state["failed_sizes"]}
        self.clean_steps = int(state["clean_steps"])
