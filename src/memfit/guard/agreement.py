"""How the ranks of a guarded step agree, and how they then combine gradients.

The protocol, once per attempt at a step (see ``docs/guard.md``):

1. Every rank runs all its micro-batches with no collective at all: the model is called through
   ``DDP.module`` under ``no_sync()``, so neither DDP's gradient buckets nor its forward-time buffer broadcast
   run. A rank that runs out of memory, wherever it happens (forward, loss, the backward of the last
   micro-batch), simply stops and reports; nobody is left waiting inside a collective.
2. The ranks exchange a few integers (ok/out of memory/fatal, samples, proposed size, non-finite flag) with one
   ``all_gather`` on a gloo group of their own. Gloo works on host memory, so this needs no GPU allocation
   right after an OOM and does not queue behind pending NCCL work. It has its own timeout, turned into a
   :class:`~memfit.errors.RankAgreementError`.
3. Only if every rank succeeded are the gradients all-reduced (agree first, then reduce). The reduction is
   in place, one parameter at a time, so it allocates nothing and cannot itself run out of memory.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from memfit.errors import RankAgreementError

# Status codes on the wire.
OK, OOM, FATAL = 0, 1, 2


@dataclass(frozen=True, kw_only=True)
class Report:
    """What one rank says after an attempt."""

    status: int
    """OK, OOM or FATAL."""
    samples: int
    """Units (samples or tokens) this rank's loss averaged over in this step."""
    proposed_size: int
    """Micro-batch size this rank proposes for the next attempt or step."""
    nonfinite: bool
    """Whether a loss on this rank was NaN or infinite."""


class RankChannel:
    """A host-memory side channel between the ranks of one process group.

    Creating it is a collective: every rank of the default group must construct it, in the same order as any
    other group they create.

    Args:
        process_group: The data-parallel group whose ranks must agree (``None``: the default group).
        timeout_s: How long to wait for the slowest rank before raising ``RankAgreementError``.
    """

    def __init__(self, process_group: dist.ProcessGroup | None, *, timeout_s: float) -> None:
        self.process_group = process_group
        ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
        # gloo: the exchange lives in host memory and on its own queue, independent of NCCL streams.
        self._group = dist.new_group(
            ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)
        )
        self.timeout_s = timeout_s
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)

    def exchange(self, report: Report) -> list[Report]:
        """Send this rank's report and receive every rank's, in rank order.

        Raises:
            RankAgreementError: Some rank did not answer within ``timeout_s`` or the group broke.
        """
        mine = torch.tensor(
            [report.status, report.samples, report.proposed_size, int(report.nonfinite)], dtype=torch.int64
        )
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        try:
            dist.all_gather(gathered, mine, group=self._group)
        except RuntimeError as exc:
            # Keep only the text: the exception's frames are small here, but do not chain across steps.
            message = str(exc)
        else:
            return [
                Report(status=int(t[0]), samples=int(t[1]), proposed_size=int(t[2]), nonfinite=bool(t[3]))
                for t in gathered
            ]
        raise RankAgreementError(
            f"Rank {self.rank} of {self.world_size} waited more than {self.timeout_s:g} s for the other ranks to "
            f"report the outcome of a guarded step, or the gloo side channel failed ({message.splitlines()[0]}). "
            "A rank probably died or hangs outside the guard; check its log. Raise agree_timeout_s if steps "
            "legitimately differ that much in duration."
        )


def reduce_gradients(
    params: Iterable[torch.nn.Parameter], process_group: dist.ProcessGroup | None, *, factor: float
) -> None:
    """Sum gradients across ranks in place, each first multiplied by ``factor``.

    With ``factor = samples_on_this_rank / samples_on_all_ranks`` the result is the gradient of the global
    sample (or token) mean, also when ranks hold different numbers of samples.

    Every rank must pass the same parameters in the same order. A parameter without a gradient gets zeros, so
    the number of collectives never differs between ranks (a mismatch would hang).
    """
    works = []
    for p in params:
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.mul_(factor)  # in place: no allocation after an OOM-prone step
        works.append(dist.all_reduce(p.grad, group=process_group, async_op=True))
    for work in works:
        work.wait()


def broadcast_buffers(module: torch.nn.Module, process_group: dist.ProcessGroup | None) -> None:
    """Copy the first rank's buffers (BatchNorm statistics) to every rank, in place, as DDP would."""
    src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    for buffer in module.buffers():
        dist.broadcast(buffer, src=src, group=process_group)
