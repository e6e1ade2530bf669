"""What a failed attempt changed is put back: device resolution and the snapshot, with a pretend GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import StrictFakeCuda
from memfit.guard.rollback import Snapshot, memory_in_use, resolve_device


def test_bare_cuda_resolves_to_the_current_device(strict_fake_cuda: StrictFakeCuda) -> None:
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device(torch.device("cuda")) == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)  # an explicit index is kept
    assert resolve_device("cpu") == torch.device("cpu")


def test_the_fake_is_as_strict_as_torch(strict_fake_cuda: StrictFakeCuda) -> None:
    """The guard's tests below rely on this: a bare "cuda" must fail here as it does on some torch versions."""
    with pytest.raises(ValueError, match="specified index"):
        torch.cuda.get_rng_state(torch.device("cuda"))
    with pytest.raises(ValueError, match="specified index"):
        torch.cuda.memory_allocated(None)


def test_snapshot_of_a_bare_cuda_device_saves_and_restores_its_generator(strict_fake_cuda: StrictFakeCuda) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    snapshot = Snapshot(model, torch.device("cuda"))
    snapshot.take()
    running_mean = model[1].running_mean.clone()
    model.train()(torch.randn(8, 3))  # forward moves the running statistics
    snapshot.restore()
    torch.testing.assert_close(model[1].running_mean, running_mean, rtol=0, atol=0)
    assert strict_fake_cuda.calls == [("get_rng_state", 1), ("set_rng_state", 1)]
    torch.testing.assert_close(strict_fake_cuda.rng_sets[0], strict_fake_cuda.rng_state, rtol=0, atol=0)


def test_memory_in_use_reads_the_resolved_device(strict_fake_cuda: StrictFakeCuda) -> None:
    assert memory_in_use(torch.device("cuda")) == (3 * 2**30, 4 * 2**30)
    assert {index for _, index in strict_fake_cuda.calls} == {1}
    assert memory_in_use(torch.device("cpu")) == (None, None)
