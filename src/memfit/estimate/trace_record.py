"""What a trace records: the allocations of a training step, in order, and what each op's output holds.

``memfit.estimate.trace`` makes a ``Trace``; the allocator replay (``memfit.estimate.allocator``), the estimate
(``memfit.estimate.predict``) and the planner's floors read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from memfit.estimate.bound import UncertaintyReason
from memfit.estimate.categories import TracedCategory
from memfit.estimate.op_costs import OpCost
from memfit.estimate.optimizer_twins import OffloadTraffic

__all__ = ["Alloc", "Trace", "output_tensors"]


@dataclass
class Alloc:
    """One storage allocation seen in the trace."""

    nbytes: int
    op: str
    module: str
    phase: str
    step: int
    shape: tuple[int, ...]
    dtype: str
    category: TracedCategory
    optional: bool = False
    """A library workspace that the library does without when memory is short (cuDNN picks another algorithm)."""


@dataclass
class Trace:
    """The allocation/free stream of one traced protocol run."""

    ops: list[int] = field(default_factory=list)  # +1 alloc, -1 free
    keys: list[int] = field(default_factory=list)  # index into allocs
    allocs: list[Alloc] = field(default_factory=list)
    phase_marks: list[tuple[int, str, int]] = field(default_factory=list)  # (event index, phase, step)
    warnings: list[str] = field(default_factory=list)
    param_count: int = 0
    uses_cublas: bool = False
    """The step calls cuBLAS (matmuls): its handles add to the CUDA context (GpuSpec.cublas_context_bytes)."""
    op_costs: list[OpCost] = field(default_factory=list)
    """What each op of the traced steps costs (memfit.estimate.op_costs), in program order; not copied by step repeats."""
    cost_marks: list[tuple[int, str, int]] = field(default_factory=list)  # (index into op_costs, phase, step)
    uncertain: dict[UncertaintyReason, str] = field(default_factory=dict)
    """Where the trace relied on a rule rather than a measurement, or lacked a value: reason -> detail (the first
    place it happened). Each widens the estimate's upper bound (memfit.estimate.bound)."""
    condition_sites: dict[str, bool] = field(default_factory=dict)
    """Where the step's conditions on tensor values were asked in forward and loss (``file.py:LINE in function``;
    not random draws) -> whether each only checks the values (memfit.estimate.branch_checks)."""
    uncertain_bytes: dict[UncertaintyReason, int] = field(default_factory=dict)
    """Reasons that widen the bound in bytes: the largest allowance of any place each happened."""
    offload: OffloadTraffic | None = None
    """What an offloaded optimizer (``Workload.optimizer_state="cpu_offload"``) moves and computes off the GPU."""

    _events: tuple[tuple[int, int], list[tuple[int, int, int]]] | None = field(
        default=None, init=False, repr=False, compare=False)

    def events(self) -> list[tuple[int, int, int]]:
        """(op, key, requested bytes) triples for the allocator simulator (kept until the trace grows: an
        estimate and the planner read them several times, 75 ms each for GPT-2 at 23k events)."""
        size = (len(self.ops), len(self.allocs))
        if self._events is None or self._events[0] != size:
            allocs = self.allocs
            self._events = (size, [
                ((2 if allocs[k].optional else 1), k, allocs[k].nbytes) if o > 0 else (-1, k, 0)
                for o, k in zip(self.ops, self.keys)
            ])
        return list(self._events[1])

    def phase_at(self, index: int) -> tuple[str, int]:
        phase, step = "init", 0
        for at, name, s in self.phase_marks:
            if at > index:
                break
            phase, step = name, s
        return phase, step


def output_tensors(out: Any) -> list[torch.Tensor]:
    """The tensors of an op's output, depth first, in ``tree_flatten`` order.

    Not ``torch.utils._pytree.tree_flatten``: each of its calls leaves a reference cycle (a recursive closure)
    for the garbage collector; called once per op, it made two thirds of a trace's cyclic garbage (166k of 244k
    objects on the MONAI Swin-UNETR estimate) and so most of the collector's runs.
    """
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if not isinstance(out, (tuple, list)):
        return []
    found: list[torch.Tensor] = []
    for item in out:
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (tuple, list, dict)):
            found.extend(output_tensors(item))
    return found
