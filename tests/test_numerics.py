"""The loss watch: which micro-batch loss is not finite (the GPU path is covered by the gpu test in test_guard)."""

from __future__ import annotations

import torch

from memfit.guard.numerics import LossWatch


def test_finite_losses_pass() -> None:
    watch = LossWatch()
    assert watch.all_finite()  # nothing recorded: nothing to object to
    watch.record([torch.tensor(1.0), torch.tensor(-2.0)])
    assert watch.all_finite() and watch.first_nonfinite() is None


def test_first_nonfinite_loss_is_found_and_clear_forgets() -> None:
    watch = LossWatch()
    watch.record([torch.tensor(1.0), torch.tensor(float("inf")), torch.tensor(float("nan"))])
    assert not watch.all_finite()
    assert watch.first_nonfinite() == 1
    watch.clear()
    assert watch.all_finite() and watch.first_nonfinite() is None
