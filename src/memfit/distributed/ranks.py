"""Per-rank GPU memory under ``torchrun``, gathered to one report, with rules that name why one GPU is heavier.

Three causes explain most "one GPU of four runs out of memory" reports (see docs/data.md):

* ``nn.DataParallel``: one process drives all GPUs and gathers outputs (and the loss, and optimizer state) on
  ``device_ids[0]``. Fix: DDP, one process per GPU.
* Extra CUDA contexts: a rank that makes a CUDA call before ``torch.cuda.set_device(local_rank)`` creates a
  context (~0.2-1 GiB, pytorch issues 49481 and 135279) and often allocations on GPU 0; so does any other process
  on that GPU.
* Uneven batches: with variable-size inputs the rank that draws the largest batch sets the peak. Fix:
  :class:`memfit.data.BalancedBatchSampler`.

This module measures (:func:`collect_rank_memory`) and gathers (:func:`gather_rank_memory`);
:mod:`memfit.distributed.imbalance` holds the rules, which work on :class:`RankMemory` records only, so they are
tested on fabricated reports.

Example:
    >>> a = RankMemory(rank=0, pid=10, device_index=0, peak_allocated_bytes=9 * 2**30,
    ...                gpu_processes=(GpuProcess(pid=10),))
    >>> b = RankMemory(rank=1, pid=11, device_index=1, peak_allocated_bytes=6 * 2**30,
    ...                gpu_processes=(GpuProcess(pid=11),))
    >>> [(f.cause, f.confidence) for f in diagnose([a, b])]  # one process per GPU: uneven, but no cause named
    [('unexplained', 'low')]
"""

from __future__ import annotations

import logging
import math
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from memfit.distributed.imbalance import DEFAULT_TOLERANCE, Finding, diagnose
from memfit.errors import UsageError
from memfit.records import JsonRecord
from memfit.units import format_bytes

__all__ = ["Finding", "GpuProcess", "RankMemory", "RankReport", "collect_rank_memory", "diagnose",
           "gather_rank_memory"]

logger = logging.getLogger(__name__)

# nvidia-ml-py reports usedGpuMemory as None, or as NVML_VALUE_NOT_AVAILABLE (2**64 - 1, nvml.h) from older
# bindings, where the driver cannot attribute memory to a process (MIG, some containers).
_NVML_NOT_AVAILABLE = 2**64 - 1


@dataclass(frozen=True, kw_only=True)
class GpuProcess(JsonRecord):
    """One process that NVML lists with a compute context on a GPU."""

    _schema: ClassVar[int | None] = None  # versioned by the RankReport that holds it

    pid: int
    """Its pid as NVML reports it (inside a container, NVML's pid namespace may differ from ``os.getpid()``)."""
    used_bytes: int | None = None
    """GPU memory the driver charges to it, ``None`` where it cannot tell (MIG, some containers)."""
    parent_pid: int | None = None
    """Its parent's pid, read from ``/proc`` on the rank's host; ``None`` if that process is not visible there."""


@dataclass(frozen=True, kw_only=True)
class RankMemory(JsonRecord):
    """Memory of one rank (one process on one GPU). Bytes are ``None`` where they were not measurable."""

    _schema: ClassVar[int | None] = None  # versioned by the RankReport that holds it
    _json_properties: ClassVar[tuple[str, ...]] = ("non_allocator_bytes", "processes_on_device")

    rank: int
    """Global rank (``RANK``); 0 outside a distributed job."""
    device_index: int | None
    """CUDA device this rank's allocations went to (``torch.cuda.current_device()``), ``None`` on CPU."""
    local_rank: int | None = None
    """``LOCAL_RANK`` from torchrun, the device it should use."""
    hostname: str = ""
    pid: int | None = None
    """``os.getpid()``: matched against NVML's process lists to tell this job's contexts from others'."""
    device_name: str = ""
    device_uuid: str | None = None
    """The GPU's UUID: the physical GPU, also where per-process ``CUDA_VISIBLE_DEVICES`` makes every index 0."""
    peak_allocated_bytes: int | None = None
    """``torch.cuda.max_memory_allocated``: tensors alive at the peak."""
    peak_reserved_bytes: int | None = None
    """``torch.cuda.max_memory_reserved``: what the caching allocator held at most."""
    reserved_bytes: int | None = None
    """``torch.cuda.memory_reserved`` read with ``device_used_bytes``: the reserve at that moment (after an OOM the
    allocator has released its cache, so the peak reserve would overstate it)."""
    device_used_bytes: int | None = None
    """``total - free`` from ``torch.cuda.mem_get_info``: the whole device, other processes and contexts included."""
    device_total_bytes: int | None = None
    gpu_processes: tuple[GpuProcess, ...] | None = None
    """NVML's compute processes on this GPU; ``None`` without ``nvidia-ml-py`` or where NVML failed."""
    batch_cost: float | None = None
    """Sum of per-sample costs (pixels, tokens) this rank processed, if the caller tracked it. Shown, not used by the
    rules: totals even out over a run while the largest batch sets the peak (2 x H200 U-Net run with
    DistributedSampler: totals 17.6M vs 17.7M pixels, per-step spread 2.27x, benchmarks/results/distributed/)."""
    max_batch_cost: float | None = None
    """Cost (tokens, pixels, padding included) of the largest batch or micro-batch this rank ran: what sets its peak."""
    max_batch_shape: tuple[int, ...] | None = None
    """Shape of the largest input this rank ran; its product stands in for ``max_batch_cost`` when that is absent."""
    data_parallel_device_ids: tuple[int, ...] | None = None
    """``device_ids`` of an ``nn.DataParallel`` in the model, ``None`` when there is none."""

    @property
    def data_parallel(self) -> bool:
        """The model contains ``nn.DataParallel``."""
        return self.data_parallel_device_ids is not None

    @property
    def non_allocator_bytes(self) -> int | None:
        """Device memory in use beyond this process's allocator reserve: CUDA contexts (its own and any other's),
        NCCL buffers, cuBLAS/cuDNN workspaces, other processes' memory."""
        if self.device_used_bytes is None:
            return None
        reserve = self.reserved_bytes if self.reserved_bytes is not None else self.peak_reserved_bytes
        return None if reserve is None else self.device_used_bytes - reserve

    @property
    def processes_on_device(self) -> int | None:
        """How many processes NVML lists on this GPU."""
        return None if self.gpu_processes is None else len(self.gpu_processes)


@dataclass(frozen=True, kw_only=True)
class RankReport(JsonRecord):
    """All ranks' memory and the diagnosis, the same on every rank after :func:`gather_rank_memory`."""

    _schema: ClassVar[int] = 2
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
        header = ("rank", "host", "gpu", "pid", "peak alloc", "peak reserved", "device used", "non-alloc",
                  "gpu pids", "max batch")
        rows = [header]
        for r in self.ranks:
            batch = (str(list(r.max_batch_shape)) if r.max_batch_shape is not None else
                     "-" if r.max_batch_cost is None else f"{r.max_batch_cost:.3g}")
            rows.append((
                str(r.rank), r.hostname, _opt(r.device_index), _opt(r.pid),
                _fmt(r.peak_allocated_bytes), _fmt(r.peak_reserved_bytes), _fmt(r.device_used_bytes),
                _fmt(r.non_allocator_bytes),
                "-" if r.gpu_processes is None else ",".join(str(p.pid) for p in r.gpu_processes) or "none",
                batch,
            ))
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
        lines += [f.format() for f in self.findings]
        if not self.findings:
            lines.append("no imbalance beyond the tolerance, no foreign context or stray process found.")
        return "\n".join(lines)


def _fmt(value: int | None) -> str:
    return "-" if value is None else format_bytes(value)


def _opt(value: int | None) -> str:
    return "-" if value is None else str(value)


def _parent_pid(pid: int) -> int | None:
    """The parent of ``pid`` from ``/proc/<pid>/stat`` (Linux), or ``None`` where that process is not visible."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after its last ")"
        return int(stat[stat.rindex(")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _nvml_handle(pynvml: Any, device_index: int, uuid: str | None) -> Any:
    if uuid:
        try:  # NVML spells a GPU's UUID "GPU-<uuid>"; torch's str(props.uuid) has no prefix
            return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
        except Exception as exc:  # an older NVML, or a MIG UUID it does not accept: fall back to the index
            logger.debug("NVML handle by UUID %s failed: %s", uuid, exc)
    # NVML numbers devices physically; map through CUDA_VISIBLE_DEVICES when it is a plain index list
    physical = device_index
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        ids = [v.strip() for v in visible.split(",")]
        if all(v.isdigit() for v in ids) and device_index < len(ids):
            physical = int(ids[device_index])
    return pynvml.nvmlDeviceGetHandleByIndex(physical)


def _nvml_processes(device_index: int, uuid: str | None) -> tuple[GpuProcess, ...] | None:
    """Processes with a compute context on a GPU, or ``None`` without ``pynvml`` (``nvidia-ml-py``) or on failure."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            handle = _nvml_handle(pynvml, device_index, uuid)
            listed = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # NVML is a diagnostic extra: never let it break a training job
        logger.debug("NVML process listing failed: %s", exc)
        return None
    processes = []
    for p in listed:
        used = getattr(p, "usedGpuMemory", None)
        processes.append(GpuProcess(pid=int(p.pid), parent_pid=_parent_pid(int(p.pid)),
                                    used_bytes=None if used is None or used >= _NVML_NOT_AVAILABLE else int(used)))
    return tuple(sorted(processes, key=lambda p: p.pid))


def _data_parallel_device_ids(model: Any) -> tuple[int, ...] | None:
    import torch.nn as nn

    if model is None:
        return None
    for m in model.modules():
        if isinstance(m, nn.DataParallel):
            return tuple(int(d) for d in m.device_ids)  # ints after DataParallel's own parsing; empty on CPU
    return None


def _shape(shape: Sequence[int] | None) -> tuple[int, ...] | None:
    return None if shape is None else tuple(int(s) for s in shape)


def collect_rank_memory(
    model: Any = None,
    *,
    batch_cost: float | None = None,
    max_batch_cost: float | None = None,
    max_batch_shape: Sequence[int] | None = None,
    device: int | None = None,
) -> RankMemory:
    """Measure this process's memory on its current CUDA device (or ``device``).

    Call it after some training steps, on every rank. On a machine without CUDA the byte fields are ``None``.

    Args:
        model: The model being trained; only checked for ``nn.DataParallel``.
        batch_cost: Total cost of the samples this rank processed (shown in the report).
        max_batch_cost: Cost of the largest batch (or micro-batch) this rank ran, padding included: the evidence
            of the uneven-batch rule. E.g. the largest ``input_ids.numel()`` seen.
        max_batch_shape: Shape of the largest input this rank ran, where a cost is not at hand.
        device: Device index to read; defaults to ``torch.cuda.current_device()``.
    """
    import torch

    if max_batch_cost is not None and not (math.isfinite(max_batch_cost) and max_batch_cost >= 0):
        raise UsageError(f"max_batch_cost must be a finite number >= 0 (tokens or pixels of the largest batch), "
                         f"got {max_batch_cost!r}.")
    common: dict[str, Any] = {
        "rank": int(os.environ.get("RANK", "0")),
        "local_rank": int(os.environ["LOCAL_RANK"]) if "LOCAL_RANK" in os.environ else None,
        "hostname": socket.gethostname(), "pid": os.getpid(), "batch_cost": batch_cost,
        "max_batch_cost": max_batch_cost, "max_batch_shape": _shape(max_batch_shape),
        "data_parallel_device_ids": _data_parallel_device_ids(model),
    }
    if not torch.cuda.is_available():
        return RankMemory(device_index=None, **common)
    index = torch.cuda.current_device() if device is None else device
    props = torch.cuda.get_device_properties(index)
    uuid = str(props.uuid) if getattr(props, "uuid", None) is not None else None
    # read the reserve and the device's free memory together: their difference is memory outside the allocator
    reserved = torch.cuda.memory_reserved(index)
    free, total = torch.cuda.mem_get_info(index)
    return RankMemory(
        device_index=index,
        device_name=props.name,
        device_uuid=uuid,
        peak_allocated_bytes=torch.cuda.max_memory_allocated(index),
        peak_reserved_bytes=torch.cuda.max_memory_reserved(index),
        reserved_bytes=reserved,
        device_used_bytes=total - free,
        device_total_bytes=total,
        gpu_processes=_nvml_processes(index, uuid),
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
        # a named cause is worth a warning; an unexplained difference is common on clean runs
        logger.log(logging.WARNING if f.names_cause else logging.INFO, "memory imbalance %s", f.format())
    return report
