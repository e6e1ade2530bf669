"""Imbalance diagnosis on fabricated per-rank reports, and the measuring and gather path on one CPU process.

The clean cases mirror what issue 16 measured on 2 H200 (DDP, GPT-2, one process per GPU): uneven peaks, rank 0
holding 600 MiB more outside its allocator's reserve, NVML listing one process per GPU. They must name no cause.
"""

from __future__ import annotations

import json
import sys
import types
from typing import Any

import pytest
import torch

from memfit.distributed.imbalance import CLEAN_NON_ALLOCATOR_SPREAD_BYTES, NON_ALLOCATOR_SPREAD_BYTES
from memfit.distributed.ranks import (
    GpuProcess,
    RankMemory,
    RankReport,
    collect_rank_memory,
    diagnose,
    gather_rank_memory,
)
from memfit.errors import UsageError

GiB = 2**30
MiB = 2**20
CONTEXT = 500 * MiB  # a rank's own CUDA context beyond its reserve


def _rank(rank: int, peak_gib: float, *, device: int | None = None, non_alloc: int = CONTEXT, **kwargs: Any) -> RankMemory:
    peak = int(peak_gib * GiB)
    reserved = int(peak * 1.1)
    fields: dict[str, Any] = {
        "local_rank": rank, "hostname": "node0", "pid": 1000 + rank, "device_name": "NVIDIA H200",
        "device_uuid": f"uuid-{rank if device is None else device}", "peak_allocated_bytes": peak,
        "peak_reserved_bytes": reserved, "reserved_bytes": reserved, "device_used_bytes": reserved + non_alloc,
        "device_total_bytes": 140 * GiB,
    }
    fields.update(kwargs)
    return RankMemory(rank=rank, device_index=rank if device is None else device, **fields)


def _with_nvml(ranks: list[RankMemory], extra: dict[int, tuple[GpuProcess, ...]] | None = None) -> list[RankMemory]:
    """Each GPU's NVML list: the pids of the ranks on it, plus ``extra[device]``."""
    extra = extra or {}
    out = []
    for r in ranks:
        own = tuple(GpuProcess(pid=o.pid or 0, used_bytes=CONTEXT) for o in ranks if o.device_uuid == r.device_uuid)
        out.append(RankMemory(**{**vars(r), "gpu_processes": own + extra.get(r.device_index or 0, ())}))
    return out


def _clean(world: int, *, nvml: bool = True) -> list[RankMemory]:
    """A clean DDP run: balanced inputs, uneven peaks (different micro-batches), rank 0 600 MiB more non-allocator."""
    ranks = [_rank(r, 20.0 + 4.0 * r, non_alloc=CONTEXT + (CLEAN_NON_ALLOCATOR_SPREAD_BYTES if r == 0 else 0),
                   max_batch_cost=8 * 1024 * (1.0 + 0.02 * r)) for r in range(world)]
    return _with_nvml(ranks) if nvml else ranks


def _causes(findings: tuple) -> list[str]:
    return [f.cause for f in findings]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("nvml", [True, False])
def test_clean_runs_name_no_cause(world: int, nvml: bool) -> None:
    ranks = _clean(world, nvml=nvml)
    assert ranks[0].non_allocator_bytes - ranks[1].non_allocator_bytes == CLEAN_NON_ALLOCATOR_SPREAD_BYTES
    findings = diagnose(ranks)
    assert not any(f.names_cause for f in findings), [f.format() for f in findings]
    # the uneven peaks are reported, at low confidence, as a difference without a cause
    assert [(f.cause, f.confidence, f.evidence) for f in findings] == [("unexplained", "low", ("peak_allocated",))]
    assert f"rank {world - 1} peaks" in findings[0].message
    # it says which evidence it checked, and what to record where evidence is missing
    assert "the largest batch per rank" in findings[0].message
    assert ("NVML's processes per GPU" in findings[0].message) == nvml and ("nvidia-ml-py" in findings[0].fix) != nvml


def test_clean_run_with_even_peaks_gives_no_findings() -> None:
    ranks = _with_nvml([_rank(r, 20.0 + 0.1 * r, max_batch_cost=1e6) for r in range(4)])
    assert diagnose(ranks) == ()
    assert "no imbalance" in RankReport(ranks=tuple(ranks), findings=()).format_table()


def test_non_allocator_spread_without_nvml_is_low_confidence_and_nvml_settles_it() -> None:
    assert NON_ALLOCATOR_SPREAD_BYTES > CLEAN_NON_ALLOCATOR_SPREAD_BYTES  # the threshold sits above the clean spread
    ranks = [_rank(0, 20.0, non_alloc=CONTEXT + 2 * GiB), _rank(1, 20.0)]
    findings = diagnose(ranks)
    assert [(f.cause, f.confidence, f.ranks, f.evidence) for f in findings] == [
        ("unexplained", "low", (0,), ("non_allocator_bytes",))]
    assert "cannot tell" in findings[0].message and "nvidia-ml-py" in findings[0].fix
    # NVML lists one process per GPU: the same spread is NCCL/cuBLAS memory of that rank, nothing to report
    assert diagnose(_with_nvml(ranks)) == ()


def test_non_allocator_memory_uses_the_reserve_at_the_moment_of_reading() -> None:
    # after an OOM the allocator has released its cache: the current reserve (20 GiB) is below the peak (30 GiB)
    r = _rank(0, 25.0, peak_reserved_bytes=30 * GiB, reserved_bytes=20 * GiB, device_used_bytes=21 * GiB)
    assert r.non_allocator_bytes == GiB
    assert RankMemory(rank=0, device_index=0, peak_reserved_bytes=3, device_used_bytes=5).non_allocator_bytes == 2


@pytest.mark.parametrize("world", [2, 4])
def test_stray_context_of_another_rank_named_from_nvml_pids(world: int) -> None:
    # the plant of issue 16: rank 1 touched GPU 0 before set_device, so its pid is in GPU 0's process list
    ranks = _clean(world)
    ranks[0] = RankMemory(**{**vars(ranks[0]), "gpu_processes": (
        GpuProcess(pid=1000, used_bytes=CONTEXT), GpuProcess(pid=1001, used_bytes=CONTEXT))})
    findings = diagnose(ranks)
    named = [f for f in findings if f.names_cause]
    assert [(f.cause, f.ranks, f.evidence, f.confidence) for f in named] == [
        ("foreign_context", (1,), ("nvml_pids",), "high")]
    assert "rank 1's process (pid 1001" in named[0].message and "GPU 0" in named[0].message
    assert "set_device" in named[0].fix
    assert not any(f.cause == "unexplained" for f in findings)  # a named cause replaces the low-confidence notes


@pytest.mark.parametrize("world", [2, 4])
def test_stray_process_outside_the_job_named_from_nvml_pids(world: int) -> None:
    ranks = _with_nvml([_rank(r, 20.0) for r in range(world)],
                       extra={0: (GpuProcess(pid=4242, used_bytes=3 * GiB),)})
    findings = diagnose(ranks)
    assert [(f.cause, f.ranks, f.evidence) for f in findings] == [("stray_process", (0,), ("nvml_pids",))]
    assert "pid 4242, 3.00 GiB" in findings[0].message and "no process of this job" in findings[0].message


def test_child_process_of_a_rank_is_named_as_such() -> None:
    ranks = _with_nvml([_rank(r, 20.0) for r in range(2)], extra={1: (GpuProcess(pid=77, parent_pid=1001),)})
    findings = diagnose(ranks)
    assert [(f.cause, f.ranks) for f in findings] == [("stray_process", (1,))]
    assert "child process of rank 1" in findings[0].message


def test_nvml_pids_from_another_namespace_fall_back_to_counts() -> None:
    # inside a container NVML reports host pids: the ranks' own pids are not in the lists
    lists = {0: (GpuProcess(pid=7), GpuProcess(pid=8)), 1: (GpuProcess(pid=9),)}
    ranks = [_rank(r, 20.0, gpu_processes=lists[r]) for r in range(2)]
    findings = diagnose(ranks)
    assert [(f.cause, f.ranks, f.evidence) for f in findings] == [("foreign_context", (0,), ("nvml_process_count",))]
    assert "2 processes" in findings[0].message
    clean = [_rank(r, 20.0, gpu_processes=(GpuProcess(pid=9 + r),)) for r in range(2)]
    assert diagnose(clean) == ()


def test_ranks_sharing_one_physical_gpu_named_from_device_identity() -> None:
    # every rank allocated on GPU 0 (no set_device): same UUID, LOCAL_RANK disagrees
    findings = diagnose([_rank(r, 10.0, device=0) for r in range(2)])
    assert [(f.cause, f.ranks, f.evidence) for f in findings] == [("foreign_context", (0, 1), ("device_identity",))]
    assert "LOCAL_RANK differs from that GPU for ranks [1]" in findings[0].message


def test_per_process_visible_devices_are_not_a_shared_gpu() -> None:
    # CUDA_VISIBLE_DEVICES=<local rank> per process: every rank's index is 0, on different physical GPUs
    ranks = [_rank(r, 10.0, device=0, device_uuid=f"uuid-{r}") for r in range(4)]
    assert diagnose(ranks) == ()


def _data_parallel(peaks_gib: list[float], ids: tuple[int, ...] | None = None) -> list[RankMemory]:
    """One process (rank 0, pid 1000) driving len(peaks) GPUs through nn.DataParallel, one record per GPU."""
    ids = tuple(range(len(peaks_gib))) if ids is None else ids
    records = [_rank(0, p, device=d, local_rank=0, pid=1000, data_parallel_device_ids=ids)
               for d, p in enumerate(peaks_gib)]
    return [RankMemory(**{**vars(r), "gpu_processes": (GpuProcess(pid=1000),)}) for r in records]


def test_data_parallel_gathering_on_gpu0_is_named_with_its_evidence() -> None:
    findings = diagnose(_data_parallel([30.0, 12.0, 12.5, 12.0]))
    assert [(f.cause, f.ranks, f.evidence) for f in findings] == [
        ("data_parallel", (0,), ("module_type", "per_gpu_peaks"))]
    assert "GPU 0 peaked at 30.00 GiB" in findings[0].message and "DistributedDataParallel" in findings[0].fix


def test_data_parallel_is_not_blamed_where_it_does_not_make_gpu0_heavy() -> None:
    assert _causes(diagnose(_data_parallel([12.0, 12.1]))) == []  # balanced: nothing to explain
    assert _causes(diagnose(_data_parallel([12.0, 20.0]))) == []  # GPU 1 heavy: not DataParallel's gather
    assert _causes(diagnose(_data_parallel([30.0], ids=(0,)))) == []  # one GPU: DataParallel just calls the module
    # only the output GPU's record: the module is the evidence
    one = diagnose(_data_parallel([30.0], ids=(0, 1)))
    assert [(f.cause, f.evidence) for f in one] == [("data_parallel", ("module_type",))]


@pytest.mark.parametrize("evidence", ["max_batch_shape", "max_batch_cost"])
def test_uneven_batch_shapes_named_when_the_costliest_rank_is_heaviest(evidence: str) -> None:
    shapes = {0: (8, 512), 1: (8, 512), 2: (8, 1024), 3: (8, 480)}

    def record(r: int, peak: float) -> RankMemory:
        kind = {"max_batch_shape": shapes[r]} if evidence == "max_batch_shape" else {
            "max_batch_cost": float(shapes[r][0] * shapes[r][1])}
        return _rank(r, peak, **kind)

    ranks = _with_nvml([record(0, 20.0), record(1, 20.5), record(2, 31.0), record(3, 19.5)])
    findings = diagnose(ranks)
    assert [(f.cause, f.ranks, f.evidence) for f in findings] == [("uneven_batches", (2,), (evidence, "peak_allocated"))]
    assert "2.13x" in findings[0].message and "BalancedBatchSampler" in findings[0].fix
    if evidence == "max_batch_shape":
        assert "shape [8, 1024] against [8, 480] on rank 3" in findings[0].message
    # the costliest input is on a light rank: inputs do not explain the heavy one
    swapped = _with_nvml([record(0, 20.0), record(1, 31.0), record(2, 20.5), record(3, 19.5)])
    assert _causes(diagnose(swapped)) == ["unexplained"]


def test_report_table_and_json_show_the_evidence() -> None:
    ranks = tuple(_with_nvml([_rank(0, 20.0, max_batch_shape=(4, 256)), _rank(1, 31.0, max_batch_shape=(4, 512))]))
    report = RankReport(ranks=ranks, findings=diagnose(ranks))
    table = report.format_table()
    assert "peak alloc" in table and "31.00 GiB" in table and "1001" in table and "[4, 512]" in table
    assert "[uneven_batches] ranks [1] (evidence: max_batch_shape, peak_allocated)" in table
    data = json.loads(json.dumps(report.to_dict()))
    assert data["schema"] == 2
    assert data["findings"][0]["evidence"] == ["max_batch_shape", "peak_allocated"]
    assert data["findings"][0]["confidence"] == "high" and data["findings"][0]["names_cause"] is True
    assert data["ranks"][0]["processes_on_device"] == 1 and data["ranks"][0]["non_allocator_bytes"] == CONTEXT
    low = RankReport(ranks=ranks[:1] + (_rank(1, 31.0),), findings=diagnose([ranks[0], _rank(1, 31.0)]))
    assert "[unexplained, low confidence]" in low.format_table()


def test_collect_and_gather_without_gpu_or_process_group() -> None:
    model = torch.nn.DataParallel(torch.nn.Linear(2, 2))  # on CPU it drives no GPU: no gather to blame
    local = collect_rank_memory(model, batch_cost=5.0, max_batch_shape=[4, 7])
    assert local.data_parallel and local.data_parallel_device_ids == () and local.batch_cost == 5.0
    assert local.max_batch_shape == (4, 7) and local.pid is not None and local.device_index is None
    report = gather_rank_memory(local)
    assert report.ranks == (local,) and report.findings == ()
    with pytest.raises(UsageError, match="max_batch_cost"):
        collect_rank_memory(max_batch_cost=float("nan"))


def test_collect_reads_the_device_and_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mocked CUDA and NVML: the GPU is found by UUID, each process's memory and parent are kept."""
    import os

    asked: list[str] = []

    def by_uuid(uuid: str) -> str:
        asked.append(uuid)
        return "handle"

    processes = [types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=CONTEXT),
                 types.SimpleNamespace(pid=os.getppid(), usedGpuMemory=2**64 - 1)]  # not attributable
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetHandleByUUID=by_uuid,
        nvmlDeviceGetHandleByIndex=lambda i: pytest.fail("the UUID lookup should have served"),
        nvmlDeviceGetComputeRunningProcesses=lambda handle: processes if handle == "handle" else [])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "current_device", lambda: 1)
    monkeypatch.setattr(cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(name="NVIDIA H200", uuid="abcd-1234"))
    monkeypatch.setattr(cuda, "memory_reserved", lambda i: 10 * GiB)
    monkeypatch.setattr(cuda, "mem_get_info", lambda i: (129 * GiB, 140 * GiB))
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda i: 8 * GiB)
    monkeypatch.setattr(cuda, "max_memory_reserved", lambda i: 12 * GiB)
    r = collect_rank_memory(max_batch_cost=4096.0)
    assert asked == ["GPU-abcd-1234"] and r.device_index == 1 and r.device_uuid == "abcd-1234"
    assert r.reserved_bytes == 10 * GiB and r.device_used_bytes == 11 * GiB and r.non_allocator_bytes == GiB
    assert [(p.pid, p.used_bytes) for p in r.gpu_processes or ()] == sorted(
        [(os.getpid(), CONTEXT), (os.getppid(), None)])
    assert {p.pid: p.parent_pid for p in r.gpu_processes or ()}[os.getpid()] == os.getppid()


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_gpu_record_lists_this_process_and_names_a_child_with_its_own_context() -> None:
    """On a real GPU: NVML's list holds this process, and a child that made a CUDA context is a stray process."""
    import os
    import subprocess

    pytest.importorskip("pynvml")
    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda:0")  # this process's own context
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, torch; torch.zeros(1, device='cuda:0'); print('ready', flush=True); "
                               "sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        r = collect_rank_memory()
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=60)
    pids = {p.pid for p in r.gpu_processes or ()}
    if os.getpid() not in pids:
        pytest.skip(f"NVML lists {sorted(pids)}, not this pid {os.getpid()}: another pid namespace")
    assert child.pid in pids and r.device_uuid
    assert r.reserved_bytes is not None and (r.non_allocator_bytes or 0) > 0  # at least our own context
    findings = diagnose([r])
    assert any(f.cause == "stray_process" and f.evidence == ("nvml_pids",) and f"pid {child.pid}" in f.message
               and "child process of rank 0" in f.message for f in findings), [f.format() for f in findings]
