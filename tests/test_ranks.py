"""Imbalance diagnosis on mocked per-rank reports, and the gather path on one CPU process."""

from __future__ import annotations

import json

from memfit.distributed.ranks import RankMemory, RankReport, collect_rank_memory, diagnose, gather_rank_memory

GiB = 2**30


def _rank(rank: int, reserved_gib: float, *, device: int | None = None, used_gib: float | None = None,
          **kwargs) -> RankMemory:
    reserved = int(reserved_gib * GiB)
    return RankMemory(
        rank=rank,
        local_rank=rank,
        hostname="node0",
        device_index=rank if device is None else device,
        peak_allocated_bytes=int(reserved * 0.9),
        peak_reserved_bytes=reserved,
        # a healthy rank: its own ~0.5 GiB context beyond the reserve
        device_used_bytes=int((used_gib if used_gib is not None else reserved_gib + 0.5) * GiB),
        device_total_bytes=80 * GiB,
        **kwargs,
    )


def test_balanced_ranks_give_no_findings() -> None:
    ranks = [_rank(r, 20.0 + 0.1 * r, batch_cost=1e6) for r in range(4)]
    assert diagnose(ranks) == ()


def test_data_parallel_is_named_with_ddp_fix() -> None:
    # one process, two devices: DataParallel gathers outputs on GPU 0
    ranks = [_rank(0, 30.0, device=0, data_parallel=True), _rank(0, 12.0, device=1, data_parallel=True)]
    findings = diagnose(ranks)
    assert [f.cause for f in findings] == ["data_parallel"]
    assert "DistributedDataParallel" in findings[0].fix


def test_missing_set_device_found_from_shared_device() -> None:
    # every rank allocated on GPU 0 (no set_device): same device index, LOCAL_RANK disagrees
    ranks = [_rank(r, 10.0, device=0) for r in range(2)]
    findings = diagnose(ranks)
    assert findings[0].cause == "foreign_context" and findings[0].ranks == (0, 1)
    assert "set_device" in findings[0].fix


def test_missing_set_device_found_from_device_overhead_and_nvml() -> None:
    # ranks on their own GPUs, but rank 0's GPU holds 3 extra contexts (3 GiB beyond its reserve)
    ranks = [_rank(0, 20.0, used_gib=23.5, processes_on_device=4)] + [
        _rank(r, 20.0, processes_on_device=1) for r in range(1, 4)]
    findings = diagnose(ranks)
    assert [f.cause for f in findings] == ["foreign_context"]
    assert findings[0].ranks == (0,)
    assert "NVML" in findings[0].message and "beyond its allocator's reserve" in findings[0].message


def test_small_overhead_differences_are_not_contexts() -> None:
    ranks = [_rank(0, 20.0, used_gib=20.6), _rank(1, 20.0, used_gib=20.5)]
    assert diagnose(ranks) == ()


def test_uneven_batches_named_when_costly_rank_is_heaviest() -> None:
    ranks = [_rank(0, 20.0, batch_cost=1.0e6), _rank(1, 31.0, batch_cost=2.2e6), _rank(2, 21.0, batch_cost=1.1e6)]
    findings = diagnose(ranks)
    assert [f.cause for f in findings] == ["uneven_batches"]
    assert findings[0].ranks == (1,) and "BalancedBatchSampler" in findings[0].fix


def test_imbalance_without_cost_is_unexplained_and_cost_mismatch_is_not_blamed() -> None:
    assert [f.cause for f in diagnose([_rank(0, 20.0), _rank(1, 30.0)])] == ["unexplained"]
    # the costly rank is not the heavy one: the batch rule must not fire
    ranks = [_rank(0, 20.0, batch_cost=3e6), _rank(1, 30.0, batch_cost=1e6)]
    assert [f.cause for f in diagnose(ranks)] == ["unexplained"]


def test_report_table_and_json() -> None:
    ranks = (_rank(0, 20.0, batch_cost=1e6), _rank(1, 31.0, batch_cost=2e6))
    report = RankReport(ranks=ranks, findings=diagnose(ranks))
    table = report.format_table()
    assert "peak reserved" in table and "31.00 GiB" in table and "[uneven_batches]" in table
    data = json.loads(json.dumps(report.to_dict()))
    assert data["schema"] == 1 and abs(data["peak_reserved_spread"] - 31 / 20) < 1e-6


def test_collect_and_gather_without_gpu_or_process_group() -> None:
    import torch

    model = torch.nn.DataParallel(torch.nn.Linear(2, 2))
    local = collect_rank_memory(model, batch_cost=5.0)
    assert local.data_parallel and local.batch_cost == 5.0
    report = gather_rank_memory(local)
    assert report.ranks == (local,)
    assert [f.cause for f in report.findings] == ["data_parallel"]
