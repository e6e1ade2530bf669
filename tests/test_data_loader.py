"""Loader settings follow cores, RAM and /dev/shm, and say why."""

from __future__ import annotations

import pytest

from memfit.data.loader import suggest_loader_settings
from memfit.errors import UsageError

GiB = 2**30
MiB = 2**20


def test_roomy_host_gets_capped_workers_and_pinning() -> None:
    s = suggest_loader_settings(batch_bytes=16 * MiB, cpu_count=64, host_memory_bytes=256 * GiB,
                                shm_bytes=64 * GiB, ranks_per_host=1, cuda=True)
    assert (s.num_workers, s.prefetch_factor, s.pin_memory) == (8, 2, True)
    assert s.as_kwargs()["persistent_workers"] is True
    assert s.in_flight_bytes == 8 * 2 * 16 * MiB + 16 * MiB


def test_small_ram_reduces_prefetch_then_workers() -> None:
    s = suggest_loader_settings(batch_bytes=1 * GiB, cpu_count=32, host_memory_bytes=16 * GiB,
                                shm_bytes=64 * GiB, ranks_per_host=1, cuda=False)
    # 25% of 16 GiB = 4 GiB: 4 batches of 1 GiB in flight at most
    assert s.num_workers * s.prefetch_factor <= 4 and s.prefetch_factor == 1
    assert any("free RAM" in r for r in s.reasons) and not s.pin_memory


def test_docker_default_shm_forces_main_process_loading() -> None:
    s = suggest_loader_settings(batch_bytes=100 * MiB, cpu_count=16, host_memory_bytes=64 * GiB,
                                shm_bytes=64 * 10**6, cuda=True)
    assert s.num_workers == 0 and s.prefetch_factor is None
    assert "prefetch_factor" not in s.as_kwargs() and any("shm-size" in r for r in s.reasons)


def test_cores_are_shared_between_ranks_and_bad_input_raises() -> None:
    s = suggest_loader_settings(batch_bytes=MiB, cpu_count=16, host_memory_bytes=64 * GiB, shm_bytes=32 * GiB,
                                ranks_per_host=4, cuda=True)
    assert s.num_workers == 3 and s.to_dict()["schema"] == 1
    with pytest.raises(UsageError):
        suggest_loader_settings(batch_bytes=0)
