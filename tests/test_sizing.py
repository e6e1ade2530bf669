"""The micro-batch size policy, with CUDA memory readings mocked (mock the hardware, not the math)."""

from __future__ import annotations

import pytest
import torch

from conftest import StrictFakeCuda
from memfit.guard.sizing import UNBOUNDED, MicroBatchSizer

GIB = 2**30
KEY = ((128,),)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """A 80 GiB card: peak/free/reserved readings come from this dict."""
    memory = {"peak": 30 * GIB, "free": 40 * GIB, "reserved": 35 * GIB, "total": 80 * GIB}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: memory["peak"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (memory["free"], memory["total"]))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: memory["reserved"])
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 1.0, raising=False)
    return memory


def test_halving_remembers_the_failed_size_per_shape() -> None:
    sizer = MicroBatchSizer(None, None, torch.device("cpu"))
    assert sizer.size_for(64) == 64
    assert sizer.shrink_proposal(KEY, 64) == 32
    assert sizer.shrink_proposal(KEY, 1) == 0  # the floor: nothing left to halve
    assert sizer.failed == {KEY: 1}


def test_no_growth_without_grow_after_or_before_enough_clean_steps() -> None:
    sizer = MicroBatchSizer(8, None, torch.device("cpu"))
    assert sizer.keep_or_grow_proposal(KEY, 8, 64, None) == 8
    sizer = MicroBatchSizer(8, 3, torch.device("cpu"))
    sizer.apply_success(8)
    assert sizer.keep_or_grow_proposal(KEY, 8, 64, None) == 8  # 2 clean steps would be the 2nd, not the 3rd
    sizer.apply_success(8)
    assert sizer.keep_or_grow_proposal(KEY, 8, 64, None) == 16
    sizer.apply_success(16)
    assert sizer.size == 16 and sizer.clean_steps == 0


def test_whole_batch_proposes_unbounded() -> None:
    assert MicroBatchSizer(None, 1, torch.device("cpu")).keep_or_grow_proposal(KEY, 64, 64, None) == UNBOUNDED


def test_growth_follows_measured_headroom(fake_cuda: dict[str, int]) -> None:
    sizer = MicroBatchSizer(8, 1, torch.device("cuda", 0))
    baseline = 20 * GIB  # peak 30 GiB at 8 -> predicted 40 GiB at 16; limit = free + reserved = 75 GiB
    assert sizer.keep_or_grow_proposal(KEY, 8, 64, baseline) == 16
    fake_cuda["free"] = 5 * GIB  # limit 40 GiB, 85 % of it is 34 GiB < 40 GiB: does not fit
    assert sizer.keep_or_grow_proposal(KEY, 8, 64, baseline) == 8


def test_memory_fraction_caps_the_limit(fake_cuda: dict[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 0.5, raising=False)
    sizer = MicroBatchSizer(8, 1, torch.device("cuda", 0))
    assert sizer.keep_or_grow_proposal(KEY, 8, 64, 20 * GIB) == 8  # 40 GiB predicted > 85 % of 40 GiB


def test_headroom_of_a_bare_cuda_device_is_read_with_its_index(strict_fake_cuda: StrictFakeCuda) -> None:
    """torch.device("cuda") without an index made get_per_process_memory_fraction raise on the H200."""
    sizer = MicroBatchSizer(8, 1, torch.device("cuda"))
    # fake: peak 5 GiB, baseline 3 GiB -> 7 GiB predicted at 16; limit = 60 GiB free + 4 GiB reserved
    assert sizer.keep_or_grow_proposal(KEY, 8, 64, 3 * GIB) == 16
    called = {name for name, _ in strict_fake_cuda.calls}
    assert {"max_memory_allocated", "mem_get_info", "memory_reserved", "get_per_process_memory_fraction"} <= called
    assert {index for _, index in strict_fake_cuda.calls} == {1}


def test_never_grows_to_a_size_that_failed(fake_cuda: dict[str, int]) -> None:
    sizer = MicroBatchSizer(None, 1, torch.device("cuda", 0))
    sizer.apply_shrink(sizer.shrink_proposal(KEY, 16))
    assert sizer.keep_or_grow_proposal(KEY, 8, 64, 1 * GIB) == 8
    assert sizer.keep_or_grow_proposal(((256,),), 8, 64, 1 * GIB) == 16  # another shape may grow


def test_state_round_trip() -> None:
    sizer = MicroBatchSizer(None, 2, torch.device("cpu"))
    sizer.apply_shrink(sizer.shrink_proposal(KEY, 16))
    other = MicroBatchSizer(None, 2, torch.device("cpu"))
    other.load_state_dict(sizer.state_dict())
    assert (other.size, other.failed, other.clean_steps) == (8, {KEY: 16}, 0)
