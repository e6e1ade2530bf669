"""The framework-neutral guard of the integrations, on CPU with a plain model: rollback and replay, the weights of
the pieces, the two-round agreement between ranks (a fake collective), and that the package imports no framework."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn

from memfit import count_tokens
from memfit.errors import RankAgreementError, StepOOMError
from memfit.integrations.window import WindowGuard

TIGHT = {"rtol": 0.0, "atol": 1e-12}


def oom() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")


def raise_oom(grad: torch.Tensor) -> torch.Tensor:
    raise oom()


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def batches(n: int, size: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(size, 4, generator=g, dtype=torch.float64),
             "y": torch.randn(size, 1, generator=g, dtype=torch.float64)} for _ in range(n)]


def window_grads(net: nn.Module, window: list[dict[str, torch.Tensor]], guard: WindowGuard | None,
                 limit: int | None = None, only: int | None = None) -> list[torch.Tensor]:
    """One accumulation window as a framework runs it: each micro-batch's mean loss / len(window), backward.

    Pieces larger than ``limit`` run out of memory in backward (after the last layer's gradients were added),
    in every micro-batch or ``only`` in the one at that index."""
    net.zero_grad(set_to_none=True)
    if guard is not None:
        guard.begin_window()
    for index, batch in enumerate(window):

        def step(part: dict[str, torch.Tensor], weight: float, index: int = index) -> torch.Tensor:
            out = net(part["x"])
            if limit is not None and part["x"].shape[0] > limit and only in (None, index):
                out.register_hook(raise_oom)
            loss = nn.functional.mse_loss(out, part["y"])
            (loss * weight / len(window)).backward()
            return loss.detach() * weight

        if guard is None:
            step(batch, 1.0)
        else:
            guard.run(batch, step)
    return [p.grad.clone() for p in net.parameters()]


def test_an_oom_in_the_third_micro_batch_replays_the_window_in_pieces() -> None:
    window = batches(3, 8)
    expected = window_grads(model(), window, None)
    net = model()
    guard = WindowGuard(net)
    # micro-batch 3 runs out of memory in its backward, after micro-batches 1 and 2 added their gradients: the
    # window is rolled back and all three run again in pieces of 4
    grads = window_grads(net, window, guard, limit=4, only=2)
    assert guard.size == 4 and guard.ooms == 1
    for g, e in zip(grads, expected):
        assert torch.allclose(g, e, **TIGHT)


def test_pieces_are_weighted_by_what_the_loss_averages_over() -> None:
    """A token-mean loss: pieces with different token counts need count_fn, or the gradient is wrong."""
    x = torch.randn(4, 3, 2, dtype=torch.float64)
    labels = torch.tensor([[1, 1, 1], [1, -100, -100], [1, 1, -100], [-100, -100, 1]])
    net = nn.Linear(2, 1).double()

    def loss_of(part: dict[str, torch.Tensor]) -> torch.Tensor:
        mask = part["labels"] != -100
        return (net(part["x"]).squeeze(-1)[mask] ** 2).mean()

    loss_of({"x": x, "labels": labels}).backward()
    expected = [p.grad.clone() for p in net.parameters()]

    def run(count_fn: Any) -> list[torch.Tensor]:
        net.zero_grad(set_to_none=True)
        guard = WindowGuard(net, count_fn=count_fn, micro_batch_size=1)

        def step(part: dict[str, torch.Tensor], weight: float) -> torch.Tensor:
            loss = loss_of(part)
            (loss * weight).backward()
            return loss.detach() * weight

        guard.run({"x": x, "labels": labels}, step)
        return [p.grad.clone() for p in net.parameters()]

    assert all(torch.allclose(g, e, **TIGHT) for g, e in zip(run(count_tokens("labels")), expected))
    assert not all(torch.allclose(g, e, **TIGHT) for g, e in zip(run(None), expected))  # samples: wrong here


class FakeRanks:
    """The collective "any" of a job whose other ranks answer from a script: one answer per round."""

    def __init__(self, others: list[bool]) -> None:
        self.others = list(others)
        self.sent: list[bool] = []

    def __call__(self, flag: bool) -> bool:
        self.sent.append(flag)
        return flag or self.others.pop(0)


def test_another_ranks_oom_makes_this_rank_replay_in_pieces_too() -> None:
    window = batches(1, 8)
    expected = window_grads(model(), window, None)
    net = model()
    ranks = FakeRanks([True, False, False])  # round 1: a rank ran out of memory; round 2: not at the floor; ok
    guard = WindowGuard(net, agree=ranks)
    grads = window_grads(net, window, guard)
    assert guard.size == 4 and guard.ooms == 1 and ranks.sent == [False, False, False]
    assert all(torch.allclose(g, e, **TIGHT) for g, e in zip(grads, expected))


def test_a_rank_that_fails_otherwise_tells_the_others_and_they_stop() -> None:
    net = model()
    ranks = FakeRanks([])

    def broken(part: Any, weight: float) -> None:
        raise KeyError("labels")

    guard = WindowGuard(net, agree=ranks)
    with pytest.raises(KeyError):
        guard.run(batches(1, 4)[0], broken)
    assert ranks.sent == [True, True]  # both rounds, so no rank waits for this one
    # ... and on the others: round 1 says something failed, round 2 says it was not an OOM this rank can outlast
    other = WindowGuard(model(), agree=FakeRanks([True, True]))
    with pytest.raises(RankAgreementError, match="Another rank failed"):
        window_grads(other.module, batches(1, 8), other)


def test_an_oom_at_one_sample_stops_with_the_oom_quoted_and_nothing_applied() -> None:
    net = model()
    guard = WindowGuard(net)
    with pytest.raises(StepOOMError, match="pieces of 1 sample .*CUDA out of memory"):
        window_grads(net, batches(1, 4), guard, limit=0)
    assert all(p.grad is None for p in net.parameters())


def test_importing_the_integrations_package_imports_no_framework() -> None:
    code = ("import sys, memfit.integrations, memfit.integrations.window; "
            "print(','.join(m for m in ('lightning', 'pytorch_lightning', 'transformers', 'accelerate') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
