"""Per-rank GPU memory under ``torchrun``, gathered to one report, with rules that name why one GPU is heavier.

Three causes explain most "one GPU of four runs out of memory" reports (see docs/data.md):

* ``nn.DataParallel``: one process drives all GPUs and gathers outputs (and the loss, and optimizer state) on
  ``device_ids[0]``. Fix: DDP, one process per GPU.
* Extra CUDA contexts: a rank that makes a CUDA call before ``torch.cuda.set_device(local_rank)`` creates a
  context (~0.2-1 GiB, pytorch issues 49481 and 135279) and often allocations on GPU 0.
* Uneven batches: with variable-size inputs the rank that draws the largest batch sets the peak. Fix:
  :class:`memfit.data.BalancedBatchSampler`.

The rules work on :class:`RankMemory` records only, so they are tested on mocked reports.

Example:
    >>> a = RankMemory(rank=0, device_index=0, peak_allocated_bytes=9 * 2**30, peak_reserved_bytes=10 * 2**30,
    ...                device_used_bytes=13 * 2**30, device_total_bytes=80 * 2**30, processes_on_device=2)
    >>> b = RankMemory(rank=1, device_index=0, peak_allocated_bytes=2**30, peak_reserved_bytes=2**30,
    ...                device_used_bytes=13 * 2**30, device_total_bytes=80 * 2**30, processes_on_device=2)
    >>> [f.cause for f in diagnose([a, b])]
    ['foreign_context']
"""

from __future__ import annotations

import logging
import os
import socket
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from memfit.records import JsonRecord
from memfit.units import MiB, format_bytes

logger = logging.getLogger(__name__)

ImbalanceCause = Literal["data_parallel", "foreign_context", "uneven_batches", "unexplained"]
"""What ``Finding.cause`` holds; ``diagnose`` says when each applies."""

# A CUDA context costs ~217 MiB (2017 reports) to ~1 GiB (recent drivers) (research/techniques.md §5.2); device
# memory beyond the allocator's reserve by more than this on one GPU, compared with the others, means a context
# or allocations that are not this rank's.
CONTEXT_BYTES_THRESHOLD = 200 * MiB

# Heavier than the lightest rank by this factor before the report calls it an imbalance worth explaining.
DEFAULT_TOLERANCE = 1.15


@dataclass(frozen=True, kw_only=True)
class RankMemory(JsonRecord):
    """Memory of one rank (one process on one GPU). Bytes are ``None`` where they were not measurable."""

    _schema: ClassVar[int | None] = None  # versioned by the RankReport that holds it

    rank: int
    """Global rank (``RANK``); 0 outside a distributed job."""
    device_index: int | None
    """CUDA device this rank's allocations went to (``torch.cuda.current_device()``), ``None`` on CPU."""
    local_rank: int | None = None
    """``LOCAL_RANK`` from torchrun, the device it should use."""
    hostname: str = ""
    device_name: str = ""
    peak_allocated_bytes: int | None = None
    """``torch.cuda.max_memory_allocated``: tensors alive at the peak."""
    peak_reserved_bytes: int | None = None
    """``torch.cuda.max_memory_reserved``: what the caching allocator held at most."""
    device_used_bytes: int | None = None
    """``total - free`` from ``torch.cuda.mem_get_info``: the whole device, other processes and contexts included."""
    device_total_bytes: int | None = None
    processes_on_device: int | None = None
    """Processes with a context on this device (from NVML), if NVML was importable."""
    batch_cost: float | None = None
    """Sum of per-sample costs (pixels, tokens) this rank processed, if the caller tracked it."""
    data_parallel: bool = False
    """The model passed in is (or contains) ``nn.DataParallel``."""


@dataclass(frozen=True, kw_only=True)
class Finding(JsonRecord):
    """One diagnosed cause of imbalance."""

    _schema: ClassVar[int | None] = None  # versioned by the RankReport that holds it

    cause: ImbalanceCause
    """``"data_parallel"``, ``"foreign_context"``, ``"uneven_batches"`` or ``"unexplained"``."""
    ranks: tuple[int, ...]
    """The ranks the finding is about (the heavy ones, or the ones missing ``set_device``)."""
    message: str
    fix: str


@dataclass(frozen=True, kw_only=True)
class RankReport(JsonRecord):
    """All ranks' memory and the diagnosis, the same on every rank after :func:`gather_rank_memory`."""

    _json_properties: ClassVar[tuple[str, ...]] = ("peak_reserved_spread",)

    ranks: tuple[RankMemory, ...]
    findings: tuple[Finding, ...] = field(default_factory=tuple)

    @property
    def peak_reserved_spread(self) -> float | None:
        """max / min of peak reserved bytes over ranks (1.0 is perfectly balanced)."""
        values = [r.peak_reserved_bytes for r in self.ranks if r.peak_reserved_bytes]
        return max(values) / min(values) if values else None

    def format_table(self) -> str:
        """Plain-text table (one row per rank) followed by the findings; the CLI renders it, the library doesn't."""
        header = ("rank", "host", "gpu", "peak alloc", "peak reserved", "device used", "procs", "batch cost")
        rows = [header]
        for r in self.ranks:
            rows.append((
                str(r.rank), r.hostname, "-" if r.device_index is None else str(r.device_index),
                _fmt(r.peak_allocated_bytes), _fmt(r.peak_reserved_bytes), _fmt(r.device_used_bytes),
                "-" if r.processes_on_device is None else str(r.processes_on_device),
                "-" if r.batch_cost is None else f"{r.batch_cost:.3g}",
            ))
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
        for f in self.findings:
            lines.append(f"[{f.cause}] ranks {list(f.ranks)}: {f.message} Fix: {f.fix}")
        return "\n".join(lines)


def _fmt(value: int | None) -> str:
    return "-" if value is None else format_bytes(value)


def _nvml_process_count(device_index: int) -> int | None:
    """Processes with a compute context on a device, or ``None`` without ``pynvml``/``nvidia-ml-py``."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            # NVML numbers devices physically; map through CUDA_VISIBLE_DEVICES when it is a plain index list
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            physical = device_index
            if visible:
                ids = [v.strip() for v in visible.split(",")]
                if all(v.isdigit() for v in ids) and device_index < len(ids):
                    physical = int(ids[device_index])
            handle = pynvml.nvmlDeviceGetHandleByIndex(physical)
            return len(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # NVML is a diagnostic extra: never let it break a training job
        logger.debug("NVML process listing failed: %s", exc)
        return None


def _uses_data_parallel(model: Any) -> bool:
    import torch.nn as nn

    return model is not None and any(isinstance(m, nn.DataParallel) for m in model.modules())


def collect_rank_memory(model: Any = None, *, batch_cost: float | None = None, device: int | None = None) -> RankMemory:
    """Measure this process's memory on its current CUDA device (or ``device``).

    Call it after some training steps, on every rank. On a machine without CUDA the byte fields are ``None``.

    Args:
        model: The model being trained; only checked for ``nn.DataParallel``.
        batch_cost: Total cost of the samples this rank processed (e.g. summed pixels), for the uneven-batch rule.
        device: Device index to read; defaults to ``torch.cuda.current_device()``.
    """
    import torch

    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ["LOCAL_RANK"]) if "LOCAL_RANK" in os.environ else None
    common: dict[str, Any] = {
        "rank": rank, "local_rank": local_rank, "hostname": socket.gethostname(), "batch_cost": batch_cost,
        "data_parallel": _uses_data_parallel(model),
    }
    if not torch.cuda.is_available():
        return RankMemory(device_index=None, **common)
    index = torch.cuda.current_device() if device is None else device
    free, total = torch.cuda.mem_get_info(index)
    return RankMemory(
        device_index=index,
        device_name=torch.cuda.get_device_name(index),
        peak_allocated_bytes=torch.cuda.max_memory_allocated(index),
        peak_reserved_bytes=torch.cuda.max_memory_reserved(index),
        device_used_bytes=total - free,
        device_total_bytes=total,
        processes_on_device=_nvml_process_count(index),
        **common,
    )


def gather_rank_memory(local: RankMemory, *, group: Any = None, tolerance: float = DEFAULT_TOLERANCE) -> RankReport:
    """Gather every rank's :class:`RankMemory` (``all_gather_object``) and diagnose; every rank gets the report.

    Outside an initialised process group the report holds just ``local``. This is a collective: call it on all
    ranks at the same point.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, local, group=group)
        records = tuple(sorted(gathered, key=lambda r: (r.rank, r.device_index or 0)))
    else:
        records = (local,)
    report = RankReport(ranks=records, findings=diagnose(records, tolerance=tolerance))
    for f in report.findings:
        logger.warning("memory imbalance [%s] ranks %s: %s Fix: %s", f.cause, list(f.ranks), f.message, f.fix)
    return report


def diagnose(ranks: Sequence[RankMemory], *, tolerance: float = DEFAULT_TOLERANCE) -> tuple[Finding, ...]:
    """Name the causes of uneven memory across ranks (or across the GPUs of a DataParallel process).

    Rules, each independent, strongest evidence first:

    1. ``data_parallel``: any record says ``nn.DataParallel`` is in use.
    2. ``foreign_context``: two ranks report the same device, or a rank's device index differs from its
       ``LOCAL_RANK``, or NVML sees more processes on a device than ranks assigned to it, or one device's memory
       beyond its allocator reserve exceeds the lightest device's by more than a CUDA context.
    3. ``uneven_batches``: per-rank batch cost varies by more than ``tolerance`` and the most expensive rank is
       the one with the highest peak.
    4. ``unexplained``: peak reserved varies by more than ``tolerance`` and no rule above fired.
    """
    findings: list[Finding] = []
    if any(r.data_parallel for r in ranks):
        findings.append(Finding(
            cause="data_parallel",
            ranks=tuple(sorted({r.rank for r in ranks if r.data_parallel})),
            message="nn.DataParallel replicates the model each step and gathers all outputs, the loss and the "
                    "optimizer state on device_ids[0], so that GPU holds far more than the others.",
            fix="use DistributedDataParallel with one process per GPU (torchrun --nproc-per-node N).",
        ))
    findings.extend(_foreign_context(ranks))
    heavy = _heaviest(ranks, tolerance)
    costs = [r.batch_cost for r in ranks]
    if heavy is not None and all(c is not None for c in costs) and min(costs) > 0:  # type: ignore[type-var, operator]
        most = max(ranks, key=lambda r: r.batch_cost or 0.0)
        ratio = (most.batch_cost or 0.0) / min(costs)  # type: ignore[type-var, operator]
        if ratio > tolerance and most.rank == heavy.rank:
            findings.append(Finding(
                cause="uneven_batches",
                ranks=(most.rank,),
                message=f"rank {most.rank} processed {ratio:.2f}x the batch cost of the lightest rank and has the "
                        "highest peak: variable-size inputs are landing unevenly.",
                fix="use memfit.data.BalancedBatchSampler(costs, batch_size=...) instead of DistributedSampler.",
            ))
    if heavy is not None and not findings:
        findings.append(Finding(
            cause="unexplained",
            ranks=(heavy.rank,),
            message=f"rank {heavy.rank} peaks above the others by more than {tolerance:.2f}x and no known cause "
                    "was detected.",
            fix="pass batch_cost to collect_rank_memory, or compare memory snapshots of the heavy and a light rank.",
        ))
    return tuple(findings)


def _heaviest(ranks: Sequence[RankMemory], tolerance: float) -> RankMemory | None:
    measured = [r for r in ranks if r.peak_reserved_bytes]
    if len(measured) < 2:
        return None
    heavy = max(measured, key=lambda r: r.peak_reserved_bytes or 0)
    light = min(measured, key=lambda r: r.peak_reserved_bytes or 0)
    return heavy if (heavy.peak_reserved_bytes or 0) > tolerance * (light.peak_reserved_bytes or 1) else None


def _foreign_context(ranks: Sequence[RankMemory]) -> list[Finding]:
    # DataParallel records are one process over several devices: the context rules are about one rank per device
    ranks = [r for r in ranks if r.device_index is not None and not r.data_parallel]
    fix = ("call torch.cuda.set_device(local_rank) first thing in each rank (before any .cuda(), torch.load or "
           "init_process_group), pass device_id to init_process_group, and torch.load(..., map_location=...).")
    suspects: set[int] = set()
    reasons: list[str] = []
    per_device = Counter((r.hostname, r.device_index) for r in ranks)
    shared = sorted({r.rank for r in ranks if per_device[(r.hostname, r.device_index)] > 1})
    if shared:
        suspects.update(shared)
        reasons.append(f"ranks {shared} all allocate on the same GPU")
    wrong = sorted({r.rank for r in ranks if r.local_rank is not None and r.local_rank != r.device_index})
    if wrong:
        suspects.update(wrong)
        reasons.append(f"ranks {wrong} use a device other than their LOCAL_RANK")
    crowded = sorted({r.rank for r in ranks
                      if r.processes_on_device is not None
                      and r.processes_on_device > per_device[(r.hostname, r.device_index)]})
    if crowded:
        suspects.update(crowded)
        reasons.append(f"NVML lists more processes than ranks on the GPU of ranks {crowded}")
    overheads = {r.rank: (r.device_used_bytes - r.peak_reserved_bytes) for r in ranks
                 if r.device_used_bytes is not None and r.peak_reserved_bytes is not None}
    if len(overheads) >= 2:
        floor = min(overheads.values())
        extra = sorted(rank for rank, o in overheads.items() if o - floor > CONTEXT_BYTES_THRESHOLD)
        if extra:
            suspects.update(extra)
            worst = max(overheads.values()) - floor
            reasons.append(f"the GPU of ranks {extra} holds {format_bytes(worst)} beyond its allocator's reserve, "
                           "more than the other GPUs (other processes' contexts)")
    if not suspects:
        return []
    return [Finding(
        cause="foreign_context",
        ranks=tuple(sorted(suspects)),
        message="; ".join(reasons) + ": CUDA contexts of other ranks sit on one GPU (torch.cuda.set_device "
                "missing or called too late).",
        fix=fix,
    )]
