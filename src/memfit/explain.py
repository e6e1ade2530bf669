"""``explain()``: why a training step needs the memory it needs, and what to change — with the user's numbers.

Every number comes from the estimator: the fixes are the same workload re-estimated with one knob turned (same
code path as ``estimate``), so a fix's predicted peak is exactly what ``memfit estimate`` says for the changed
workload.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from memfit.estimate import Estimate

SCHEMA = 1


@dataclass(frozen=True)
class Part:
    """One category of the memory at the peak."""

    category: str
    """params, buffers, grads, optimizer_state, activations, temporaries, workspaces, data, fragmentation."""
    nbytes: int
    share: float
    """Of ``fits_in_bytes`` (the memory the step needs)."""
    detail: str = ""
    """What inside it, in the user's words (e.g. the blocks holding most activations)."""


@dataclass(frozen=True)
class BlockMemory:
    """Activation bytes held for backward by one block (or a module outside any block) at the end of forward."""

    name: str
    nbytes: int


@dataclass(frozen=True)
class Scaling:
    """How the needed memory grows: ``fits_in ≈ fixed + per_sample × micro-batch``, from two estimates."""

    fixed_bytes: int
    """Needed at zero samples: weights, gradients, optimizer state, workspaces (extrapolated)."""
    per_sample_bytes: int
    batch_sizes: tuple[int, int]
    """The two micro-batch sizes estimated."""
    input_unit: str
    """``voxel``, ``pixel``, ``token`` or ``element``: what one input position is."""
    input_shape: tuple[int, ...]
    """One sample's main input, without the batch axis."""
    elements_per_sample: int
    """Input positions per sample (voxels, pixels, tokens)."""
    bytes_per_element: float
    """``per_sample_bytes / elements_per_sample``: what one more voxel/pixel/token of input costs."""


@dataclass(frozen=True)
class Fix:
    """One change to the step, re-estimated."""

    name: str
    """Short, imperative: ``micro-batch 2 × 4 accumulation``."""
    knob: str
    """micro_batch, precision, checkpointing, channels_last, optimizer, expandable_segments, patch, combined."""
    changes: dict[str, Any]
    """The Workload fields changed (``Workload.replace(**changes)`` reproduces it)."""
    allocator: str | None
    """The ``PYTORCH_CUDA_ALLOC_CONF`` it needs, if any."""
    peak_allocated_bytes: int
    fits_in_bytes: int
    device_bytes: int
    saving_bytes: int
    """Base ``fits_in_bytes`` minus this one's: positive saves memory."""
    time_factor: float | None
    """Predicted step time relative to the current step (1.25 = 25 % slower); None where no model says."""
    speed_cost: str
    """What it costs in speed, in words."""
    changes_training: str
    """``no`` (same mathematics), ``numerics`` (same algorithm, other rounding) or ``semantics`` (e.g. BatchNorm
    statistics over smaller batches, less context per patch)."""
    caveat: str = ""
    fits_budget: bool | None = None


@dataclass(frozen=True)
class Explanation:
    """Why the step needs what it needs, and the fixes, ranked (largest saving first)."""

    workload: str
    gpu: str
    estimate: Estimate
    headline: str
    """One sentence: how much, and the dominant cause."""
    parts: list[Part]
    blocks: list[BlockMemory]
    """Activation bytes per block, largest first."""
    peak_when: str
    peak_why: str
    scaling: Scaling | None
    scaling_text: str
    fixes: list[Fix]
    budget_bytes: int | None = None
    fits_budget: bool | None = None
    combination: Fix | None = None
    """With a budget the step does not fit: the cheapest set of fixes that makes it fit, re-estimated together."""
    oom: dict[str, Any] | None = None
    """The parsed CUDA OOM message and its diagnosis, when one was given."""
    notes: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    schema: int = SCHEMA

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["schema"] = SCHEMA
        return d

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)
