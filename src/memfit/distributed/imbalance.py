"""Rules that name why one rank (or one GPU) holds more memory than the others, each from stated evidence.

A rule names a cause only from direct evidence, and every :class:`Finding` lists the evidence it used:

* ``data_parallel`` — the model is an ``nn.DataParallel`` over several GPUs (``module_type``), and where the
  process's per-GPU records exist, its output device is the heaviest (``per_gpu_peaks``).
* ``foreign_context`` — a CUDA context of another rank of this job on a rank's GPU: NVML's process list shows that
  rank's pid there (``nvml_pids``), several ranks' current device is one physical GPU (``device_identity``), or,
  where NVML's pids cannot be matched to the ranks' (a container's pid namespace), NVML counts more processes on a
  GPU than ranks use it (``nvml_process_count``).
* ``stray_process`` — NVML lists a pid on a rank's GPU that is no rank of this job (``nvml_pids``).
* ``uneven_batches`` — the heaviest rank also ran the costliest largest batch, by more than the tolerance
  (``max_batch_cost``, or ``max_batch_shape`` when only shapes were recorded).

Memory on a GPU outside the allocator's reserve is *not* evidence of a foreign context: NCCL's buffers, cuBLAS
workspaces and lazily created handles legitimately differ by rank (issue 16: rank 0 of a clean 2-rank DDP run held
600 MiB more than rank 1, with NVML listing one process per GPU). Without NVML, a difference well above that is
reported as ``unexplained`` with ``confidence="low"``; so are uneven peaks no rule explains. Neither names a cause.

Example:
    >>> from memfit.distributed.ranks import GpuProcess, RankMemory
    >>> gpu0 = (GpuProcess(pid=100), GpuProcess(pid=101))  # NVML on GPU 0: rank 0's process and rank 1's
    >>> a = RankMemory(rank=0, pid=100, device_index=0, peak_allocated_bytes=2**30, gpu_processes=gpu0)
    >>> b = RankMemory(rank=1, pid=101, device_index=1, peak_allocated_bytes=2**30,
    ...                gpu_processes=(GpuProcess(pid=101),))
    >>> [(f.cause, f.ranks, f.evidence) for f in diagnose([a, b])]
    [('foreign_context', (1,), ('nvml_pids',))]
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

from memfit.records import JsonRecord
from memfit.units import MiB, format_bytes

if TYPE_CHECKING:  # ranks.py imports this module; the records are only read here
    from memfit.distributed.ranks import RankMemory

ImbalanceCause = Literal["data_parallel", "foreign_context", "stray_process", "uneven_batches", "unexplained"]
"""What ``Finding.cause`` holds; the module docstring says when each applies."""

Evidence = Literal[
    "module_type",  # the model contains nn.DataParallel over several device_ids
    "per_gpu_peaks",  # peak allocated bytes of each GPU one DataParallel process drives
    "nvml_pids",  # NVML's compute processes on a GPU, matched against the ranks' own pids
    "nvml_process_count",  # how many processes NVML lists on a GPU, against how many ranks use it
    "device_identity",  # each rank's current CUDA device, as a physical GPU (UUID, else host and index)
    "max_batch_cost",  # the cost (tokens, pixels) of the largest batch each rank ran
    "max_batch_shape",  # the shape of the largest input each rank ran
    "peak_allocated",  # each rank's peak allocated bytes (peak reserved where allocated is missing)
    "non_allocator_bytes",  # device memory in use minus the allocator's reserve, per GPU
]
"""What a rule looked at; ``Finding.evidence`` lists these."""

Confidence = Literal["high", "low"]
"""``high``: a cause named from direct evidence. ``low``: an unexplained difference, no cause named."""

# The heaviest rank's peak over the lightest's before the report calls it an imbalance. Above the 1.07 that a clean
# run with BalancedBatchSampler showed (U-Net, 2 x H200, run peak max/min: benchmarks/results/distributed/
# multigpu_2xh200_torch2.11_20261126.md), below the 1.26 of the same run with DistributedSampler.
DEFAULT_TOLERANCE = 1.15

# The largest spread of non-allocator memory (device used - reserved) measured between the GPUs of a clean run:
# 600 MiB, rank 0 over rank 1, 2 x H200, HF GPT-2 under DDP and TrainStep, NVML listing one process per GPU
# (issue 16). NCCL buffers, cuBLAS workspaces and lazy CUDA handles differ by rank.
CLEAN_NON_ALLOCATOR_SPREAD_BYTES = 600 * MiB
# Without NVML, a spread up to twice the clean one says nothing; above it the report mentions it, at low
# confidence and without a cause (another process's CUDA context costs ~0.2-1 GiB, research/techniques.md §5.2,
# so a single stray context can stay below this: NVML's process list is what finds those).
NON_ALLOCATOR_SPREAD_BYTES = 2 * CLEAN_NON_ALLOCATOR_SPREAD_BYTES

_SET_DEVICE_FIX = ("call torch.cuda.set_device(local_rank) first thing in each rank (before any .cuda(), torch.load "
                   "or init_process_group), pass device_id to init_process_group, and torch.load(..., "
                   "map_location=...).")


@dataclass(frozen=True, kw_only=True)
class Finding(JsonRecord):
    """One diagnosed cause of imbalance, or one unexplained difference, with the evidence behind it."""

    _schema: ClassVar[int | None] = None  # versioned by the RankReport that holds it
    _json_properties: ClassVar[tuple[str, ...]] = ("names_cause",)

    cause: ImbalanceCause
    """The cause (see the module docstring), or ``"unexplained"``: a difference memfit has no evidence for."""
    ranks: tuple[int, ...]
    """The ranks the finding is about: the heavy ones, or the ones whose context sits on another rank's GPU."""
    evidence: tuple[Evidence, ...]
    """What the rule looked at to conclude this."""
    confidence: Confidence
    """``"high"`` for a cause from direct evidence, ``"low"`` for an unexplained difference."""
    message: str
    fix: str

    @property
    def names_cause(self) -> bool:
        """True when the finding names a cause (everything but ``unexplained``)."""
        return self.cause != "unexplained"

    def format(self) -> str:
        """One line: cause, ranks, evidence, message, fix."""
        label = self.cause if self.confidence == "high" else f"{self.cause}, low confidence"
        return (f"[{label}] ranks {list(self.ranks)} (evidence: {', '.join(self.evidence)}): {self.message} "
                f"Fix: {self.fix}")


def diagnose(ranks: Sequence[RankMemory], *, tolerance: float = DEFAULT_TOLERANCE) -> tuple[Finding, ...]:
    """Name the causes of uneven memory across ranks (or across the GPUs of a DataParallel process).

    Each rule is independent and uses only the evidence its finding lists (module docstring). When no rule names
    a cause, uneven peaks (by more than ``tolerance``) and, without NVML, a non-allocator spread above
    ``NON_ALLOCATOR_SPREAD_BYTES`` are reported as ``unexplained`` at low confidence.
    """
    findings = [*_data_parallel(ranks, tolerance), *_shared_gpus(ranks), *_nvml_contexts(ranks),
                *_uneven_inputs(ranks, tolerance)]
    if not any(f.names_cause for f in findings):
        findings += _unexplained(ranks, tolerance)
    return tuple(findings)


# ------------------------------------------------------------------------------------------------- helpers


def _peak(r: RankMemory) -> int | None:
    return r.peak_allocated_bytes if r.peak_allocated_bytes is not None else r.peak_reserved_bytes


def _gpu(r: RankMemory) -> tuple[str, str | int | None]:
    """A physical GPU: its UUID where known (per-process CUDA_VISIBLE_DEVICES makes every index 0), else its index."""
    return (r.hostname, r.device_uuid if r.device_uuid else r.device_index)


def _gpu_name(owners: Sequence[RankMemory]) -> str:
    r = owners[0]
    host = f" of {r.hostname}" if r.hostname else ""
    return f"GPU {r.device_index}{host}"


def _process(r: RankMemory) -> tuple[str, int]:
    """One process of the job: its pid where recorded, else its rank."""
    return ("pid", r.pid) if r.pid is not None else ("rank", r.rank)


def _one_per_gpu(ranks: Sequence[RankMemory]) -> list[RankMemory]:
    """Records of processes that own one GPU each (DataParallel processes drive several and are ruled apart)."""
    return [r for r in ranks if r.device_index is not None and not r.data_parallel]


def _heavy_and_light(ranks: Sequence[RankMemory], tolerance: float) -> tuple[RankMemory, RankMemory] | None:
    measured = [r for r in ranks if _peak(r)]
    if len(measured) < 2:
        return None
    heavy = max(measured, key=lambda r: _peak(r) or 0)
    light = min(measured, key=lambda r: _peak(r) or 0)
    return (heavy, light) if (_peak(heavy) or 0) > tolerance * (_peak(light) or 1) else None


# --------------------------------------------------------------------------------------------------- rules


def _data_parallel(ranks: Sequence[RankMemory], tolerance: float) -> list[Finding]:
    findings = []
    processes: dict[tuple[str, tuple[str, int]], list[RankMemory]] = defaultdict(list)
    for r in ranks:
        if r.data_parallel_device_ids is not None and len(r.data_parallel_device_ids) >= 2:  # one GPU: no gather
            processes[(r.hostname, _process(r))].append(r)
    for records in processes.values():
        ids = records[0].data_parallel_device_ids or ()
        output = ids[0]
        peaks = {r.device_index: r.peak_allocated_bytes for r in records
                 if r.device_index in ids and r.peak_allocated_bytes is not None}
        evidence: tuple[Evidence, ...] = ("module_type",)
        detail = ""
        if len(peaks) >= 2:
            light = min(peaks.values())
            if peaks.get(output) != max(peaks.values()) or peaks[output] <= tolerance * max(light, 1):
                continue  # DataParallel, but its output GPU is not the heavy one: not what makes this uneven
            evidence += ("per_gpu_peaks",)
            detail = (f" Here GPU {output} peaked at {format_bytes(peaks[output])}, the others of this process at "
                      f"{format_bytes(light)} to {format_bytes(max(v for d, v in peaks.items() if d != output))}.")
        findings.append(Finding(
            cause="data_parallel",
            ranks=(records[0].rank,),
            evidence=evidence,
            confidence="high",
            message=f"the model is an nn.DataParallel over GPUs {list(ids)}: each step it replicates the model from "
                    f"GPU {output} and gathers all outputs and the loss there, where the gradients and optimizer "
                    f"state also live, so GPU {output} holds far more than the others.{detail}",
            fix="use DistributedDataParallel with one process per GPU (torchrun --nproc-per-node N).",
        ))
    return findings


def _shared_gpus(ranks: Sequence[RankMemory]) -> list[Finding]:
    by_gpu: dict[tuple[str, str | int | None], list[RankMemory]] = defaultdict(list)
    for r in _one_per_gpu(ranks):
        by_gpu[_gpu(r)].append(r)
    suspects: set[int] = set()
    reasons = []
    for owners in by_gpu.values():
        if len({_process(r) for r in owners}) < 2:
            continue
        shared = sorted(r.rank for r in owners)
        suspects.update(shared)
        astray = sorted(r.rank for r in owners if r.local_rank is not None and r.local_rank != r.device_index)
        hint = f" (LOCAL_RANK differs from that GPU for ranks {astray})" if astray else ""
        reasons.append(f"ranks {shared} all have {_gpu_name(owners)} as their current device{hint}")
    if not reasons:
        return []
    return [Finding(
        cause="foreign_context",
        ranks=tuple(sorted(suspects)),
        evidence=("device_identity",),
        confidence="high",
        message="; ".join(reasons) + ": each of those processes holds its own CUDA context and its tensors on one "
                "GPU (torch.cuda.set_device missing or called with the wrong index).",
        fix=_SET_DEVICE_FIX,
    )]


def _nvml_contexts(ranks: Sequence[RankMemory]) -> list[Finding]:
    job = {r.pid: r for r in ranks if r.pid is not None}
    by_gpu: dict[tuple[str, str | int | None], list[RankMemory]] = defaultdict(list)
    for r in ranks:
        if r.device_index is not None and r.gpu_processes:  # an empty list (a sandbox's NVML) is no evidence
            by_gpu[_gpu(r)].append(r)
    foreign: dict[int, list[str]] = defaultdict(list)  # the rank whose context is astray -> where
    stray: dict[int, list[str]] = defaultdict(list)  # the rank whose GPU holds an outside process -> what
    counted: dict[int, str] = {}
    for owners in by_gpu.values():
        listed = {p.pid: p for r in owners for p in r.gpu_processes or ()}
        own = {r.pid for r in owners if r.pid is not None}
        owner_ranks = ", ".join(str(rank) for rank in sorted(r.rank for r in owners))
        where = f"{_gpu_name(owners)} (the GPU of rank{'s' if len(owners) > 1 else ''} {owner_ranks})"
        if own and own <= listed.keys():  # NVML's pids are the ranks' pids: one pid namespace
            for pid, proc in sorted(listed.items()):
                used = f", {format_bytes(proc.used_bytes)}" if proc.used_bytes is not None else ""
                if pid in own:
                    continue
                if pid in job:
                    foreign[job[pid].rank].append(f"NVML lists rank {job[pid].rank}'s process (pid {pid}{used}) "
                                                  f"on {where}")
                    continue
                parent = job.get(proc.parent_pid) if proc.parent_pid is not None else None
                what = (f"a child process of rank {parent.rank} (a DataLoader worker, a compile worker or another "
                        "subprocess that used CUDA)" if parent is not None else
                        "no process of this job (another job, a leftover process, or a subprocess started "
                        "outside the ranks)")
                for r in owners:
                    stray[r.rank].append(f"NVML lists pid {pid}{used} on {where}, {what}")
        else:  # pids not comparable (a container's pid namespace): only the number of processes says something
            expected = len({_process(r) for r in owners})
            if len(listed) > expected:
                counted[min(r.rank for r in owners)] = (
                    f"NVML lists {len(listed)} processes with a CUDA context on {where}, where {expected} "
                    f"process{'es' if expected > 1 else ''} of this job run{'' if expected > 1 else 's'}")
    findings = []
    if foreign:
        findings.append(Finding(
            cause="foreign_context", ranks=tuple(sorted(foreign)), evidence=("nvml_pids",), confidence="high",
            message="; ".join(m for rank in sorted(foreign) for m in foreign[rank])
                    + ": those ranks made CUDA calls on a GPU other than their own (before torch.cuda.set_device, "
                    "or with an explicit device), and each such context holds memory on that GPU.",
            fix=_SET_DEVICE_FIX))
    if counted:
        findings.append(Finding(
            cause="foreign_context", ranks=tuple(sorted(counted)), evidence=("nvml_process_count",),
            confidence="high",
            message="; ".join(counted[rank] for rank in sorted(counted))
                    + ": the extra contexts belong to other ranks (set_device missing) or to other programs; NVML's "
                    "pids could not be matched to the ranks' (a different pid namespace), so memfit cannot say which.",
            fix=_SET_DEVICE_FIX + " Check nvidia-smi on the node for processes that are not this job's."))
    if stray:
        findings.append(Finding(
            cause="stray_process", ranks=tuple(sorted(stray)), evidence=("nvml_pids",), confidence="high",
            message="; ".join(dict.fromkeys(m for rank in sorted(stray) for m in stray[rank]))
                    + ": its CUDA context and memory are not this job's, but count against this GPU.",
            fix="end the process if it is a leftover (nvidia-smi shows it), keep CUDA out of DataLoader workers "
                "and collate functions, and give other jobs other GPUs (CUDA_VISIBLE_DEVICES)."))
    return findings


def _batch_costs(ranks: Sequence[RankMemory]) -> tuple[dict[int, float], Evidence, dict[int, str]] | None:
    """Each rank's largest-batch cost, from max_batch_cost, else from max_batch_shape; None if any rank lacks both."""
    if all(r.max_batch_cost is not None for r in ranks):
        return {r.rank: float(r.max_batch_cost or 0.0) for r in ranks}, "max_batch_cost", {}
    if all(r.max_batch_shape is not None for r in ranks):
        shapes = {r.rank: tuple(r.max_batch_shape or ()) for r in ranks}
        return ({rank: float(math.prod(s)) for rank, s in shapes.items()}, "max_batch_shape",
                {rank: str(list(s)) for rank, s in shapes.items()})
    return None


def _uneven_inputs(ranks: Sequence[RankMemory], tolerance: float) -> list[Finding]:
    ranks = _one_per_gpu(ranks)
    pair = _heavy_and_light(ranks, tolerance)
    costs = _batch_costs(ranks) if pair else None
    if pair is None or costs is None:
        return []
    heavy, light = pair
    cost, evidence, shapes = costs
    cheapest = min(cost.values())
    if cost[heavy.rank] != max(cost.values()) or cheapest <= 0 or cost[heavy.rank] <= tolerance * cheapest:
        return []  # the inputs are even, or the costliest rank is not the heavy one: inputs do not explain it
    low = min(cost, key=lambda rank: cost[rank])
    what = (f"shape {shapes[heavy.rank]} against {shapes[low]} on rank {low}" if shapes else
            f"{cost[heavy.rank] / cheapest:.2f}x the cost of rank {low}'s")
    return [Finding(
        cause="uneven_batches",
        ranks=(heavy.rank,),
        evidence=(evidence, "peak_allocated"),
        confidence="high",
        message=f"rank {heavy.rank}'s largest batch ({what}) is the costliest of all ranks, by "
                f"{cost[heavy.rank] / cheapest:.2f}x, and rank {heavy.rank} peaks highest "
                f"({format_bytes(_peak(heavy) or 0)} against {format_bytes(_peak(light) or 0)} on rank "
                f"{light.rank}): variable-size inputs land unevenly on the ranks.",
        fix="use memfit.data.BalancedBatchSampler(costs, batch_size=...) instead of DistributedSampler, or pad/bucket "
            "inputs to fixed shapes.",
    )]


def _unexplained(ranks: Sequence[RankMemory], tolerance: float) -> list[Finding]:
    ranks = _one_per_gpu(ranks)
    findings = []
    pair = _heavy_and_light(ranks, tolerance)
    if pair is not None:
        heavy, light = pair
        checked, hints = [], []
        if _batch_costs(ranks):
            checked.append("the largest batch per rank")
        else:
            hints.append("pass max_batch_cost= (or max_batch_shape=) to collect_rank_memory")
        if all(r.gpu_processes for r in ranks):
            checked.append("NVML's processes per GPU")
        else:
            hints.append("pip install nvidia-ml-py")
        hints.append("compare memory snapshots of the heavy and a light rank "
                     "(torch.cuda.memory._record_memory_history).")
        findings.append(Finding(
            cause="unexplained", ranks=(heavy.rank,), evidence=("peak_allocated",), confidence="low",
            message=f"rank {heavy.rank} peaks at {format_bytes(_peak(heavy) or 0)}, "
                    f"{(_peak(heavy) or 0) / (_peak(light) or 1):.2f}x rank {light.rank}'s "
                    f"{format_bytes(_peak(light) or 0)}, and no rule found a cause"
                    + (f" ({' and '.join(checked)} showed none)" if checked else "")
                    + ". On a clean run this is common (different inputs or micro-batches per rank, the allocator's "
                      "history) and only matters if that rank runs out of memory.",
            fix="; ".join(hints),
        ))
    if not all(r.gpu_processes for r in ranks):  # NVML's list settles contexts; without it, mention a large spread
        extra = {r.rank: r.non_allocator_bytes for r in ranks if r.non_allocator_bytes is not None}
        if len(extra) >= 2:
            floor = min(extra.values())
            over = sorted(rank for rank, b in extra.items() if b - floor > NON_ALLOCATOR_SPREAD_BYTES)
            if over:
                spread = max(extra.values()) - floor
                findings.append(Finding(
                    cause="unexplained", ranks=tuple(over), evidence=("non_allocator_bytes",), confidence="low",
                    message=f"the GPU of rank{'s' if len(over) > 1 else ''} {', '.join(map(str, over))} holds up to "
                            f"{format_bytes(spread)} more outside the allocator's reserve than the lightest GPU, above "
                            f"the {format_bytes(NON_ALLOCATOR_SPREAD_BYTES)} this report tolerates. It may be "
                            "another process's CUDA context or NCCL/cuBLAS buffers that differ by rank; without "
                            "NVML's process list memfit cannot tell which.",
                    fix="pip install nvidia-ml-py so the report lists the processes on each GPU, or run nvidia-smi "
                        "on the node while the job runs.",
                ))
    return findings
