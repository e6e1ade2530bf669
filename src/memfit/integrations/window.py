"""The guard inside a framework's accumulation window: a micro-batch that runs out of memory runs again in pieces.

Lightning, the Hugging Face Trainer and Accelerate each call the user's step once per micro-batch and accumulate
gradients over ``accumulation_steps`` calls (the window) before one optimizer step. ``memfit.TrainStep`` owns a
whole effective batch; here the framework hands over one micro-batch at a time, so ``WindowGuard`` remembers the
window's micro-batches so far. When a micro-batch runs out of memory (on any rank), every rank puts back what the
window changed (gradients set to ``None``, as ``zero_grad(set_to_none=True)`` left them at the window's start;
norm-layer statistics and RNG states from ``memfit.guard.rollback.Snapshot``), halves the piece size, and runs
the window's micro-batches again, each cut into pieces whose losses are weighted by their share of samples (or
tokens). The sum of the pieces' gradients is the gradient of the whole micro-batch, so after the window the
gradients are those of a run that never ran out of memory (to rounding), and no sample is lost.

Cost: nothing while nothing runs out of memory (a micro-batch that fits runs whole, as the framework would run
it); the window's earlier micro-batches are kept by reference until the window ends (the Hugging Face Trainer
holds them anyway; under Lightning this keeps up to ``accumulation_steps - 1`` input batches alive); an OOM costs
a replay of the window so far. Under ``torch.distributed`` the ranks agree once per micro-batch (the framework's
own collective, given as ``agree``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memfit.errors import RankAgreementError, StepOOMError
from memfit.guard import microbatch
from memfit.guard.oom import is_oom
from memfit.guard.rollback import Snapshot, memory_in_use
from memfit.units import format_bytes

__all__ = ["Agree", "PieceStep", "WindowGuard"]

logger = logging.getLogger(__name__)

PieceStep = Callable[[Any, float], "torch.Tensor | None"]
"""``step(piece, weight) -> loss``: forward, loss and backward of one piece, its loss multiplied by ``weight``
(the piece's share of the micro-batch) before backward; returns that weighted loss, detached (or None when the
user's step skipped it)."""

Agree = Callable[[bool], bool]
"""``agree(flag) -> any rank's flag``: the framework's collective "any" over the data-parallel ranks."""


class WindowGuard:
    """Runs one micro-batch at a time; after an OOM, rolls the window back and runs it again in smaller pieces.

    Args:
        module: The model whose gradients accumulate (not a DDP wrapper).
        agree: The framework's collective "any" (e.g. Lightning's ``strategy.reduce_boolean_decision(flag,
            all=False)``); None for one process.
        splitter: How to size and cut batches (default: tensors, tuples, lists and dicts along dimension 0).
        count_fn: Units each piece's loss is a mean over (default: samples); ``memfit.count_tokens("labels")``
            for a loss averaged over tokens.
        micro_batch_size: Samples per piece to start with; None runs each micro-batch whole.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        agree: Agree | None = None,
        splitter: microbatch.BatchSplitter | None = None,
        count_fn: microbatch.CountFn | None = None,
        micro_batch_size: int | None = None,
    ) -> None:
        self.module = module
        self.agree = agree
        self.splitter: microbatch.BatchSplitter = splitter or microbatch.TensorSplitter()
        self.count_fn = count_fn or self.splitter.size
        self.size = micro_batch_size
        """Samples per piece (None: the whole micro-batch), the same on every rank."""
        self.ooms = 0
        """Attempts that ran out of memory (on any rank) and were run again."""
        self._window: list[tuple[Any, PieceStep]] = []
        param = next(module.parameters(), None)
        self._device = param.device if param is not None else torch.device("cpu")
        self._snapshot = Snapshot(module, self._device)  # allocated once: each window only copies into it
        self._snapshot_taken = False

    def begin_window(self) -> None:
        """Call at the first micro-batch of each accumulation window, after the gradients were zeroed."""
        self._window.clear()
        self._snapshot.take()
        self._snapshot_taken = True

    def run(self, batch: Any, step: PieceStep) -> torch.Tensor | None:
        """Run ``step`` on ``batch`` (in pieces if the size says so), retrying smaller after an OOM on any rank.

        Returns:
            The micro-batch's loss (the sum of the pieces' weighted losses, detached), or None if every piece
            was skipped.

        Raises:
            StepOOMError: Out of memory even in pieces of one sample (on any rank); gradients are left rolled back.
            RankAgreementError: Another rank failed with an error that was not an OOM.
        """
        if not self._snapshot_taken:
            self.begin_window()
        self._window.append((batch, step))
        first = len(self._window) - 1  # the first attempt runs only this micro-batch
        while True:
            failure: str | None = None
            loss: torch.Tensor | None = None
            try:
                for index in range(first, len(self._window)):
                    loss = self._run_pieces(*self._window[index])
            except Exception as exc:
                if not is_oom(exc):
                    self._announce_fatal()
                    raise
                failure = f"{type(exc).__name__}: {exc}"
            # exc and its frames are gone here: the failed attempt's activations are free before the retry
            if not self._any(failure is not None):
                return loss
            self.ooms += 1
            size = self._piece_size_now()
            floor = failure is not None and size <= 1
            if self._any(floor):  # some rank cannot split further: every rank stops, none waits for the others
                self._roll_back()
                raise self._floor_error(failure if floor else None)
            self._log_shrink(failure, size)
            self.size = max(1, size // 2)
            self._roll_back()
            first = 0  # replay the window so far, then this micro-batch, at the new size

    # -- helpers ----------------------------------------------------------------------------------------------

    def _run_pieces(self, batch: Any, step: PieceStep) -> torch.Tensor | None:
        n = self.splitter.size(batch)
        if self.size is None or self.size >= n:
            return step(batch, 1.0)  # fits as the framework runs it: no split, no count, no host sync
        pieces = self.splitter.split(batch, self.size)
        raw = [self.count_fn(p) for p in pieces]
        counts = [int(c) for c in raw]  # one host sync per count returned as a tensor (token counts)
        total = sum(counts)
        loss: torch.Tensor | None = None
        for piece, count in zip(pieces, counts):
            if total and not count:
                continue  # nothing counted (all tokens ignored): no contribution, skip the work
            # weight = this piece's share of the micro-batch's samples (or tokens): the weighted sum is its mean
            out = step(piece, count / total if total else 1.0 / len(pieces))
            if out is not None:
                loss = out if loss is None else loss + out
        return loss

    def _piece_size_now(self) -> int:
        """The piece size the failed attempt used on this rank (the largest micro-batch of the window, when whole)."""
        if self.size is not None:
            return self.size
        return max(self.splitter.size(b) for b, _ in self._window)

    def _any(self, flag: bool) -> bool:
        return flag if self.agree is None else bool(self.agree(flag))

    def _announce_fatal(self) -> None:
        """Tell the other ranks this one is failing (both rounds of the protocol), so none waits for it."""
        if self.agree is not None:
            self.agree(True)
            self.agree(True)

    def _roll_back(self) -> None:
        for p in self.module.parameters():
            p.grad = None  # as zero_grad(set_to_none=True) left them at the window's start
        self._snapshot.restore()

    def _log_shrink(self, failure: str | None, size: int) -> None:
        allocated, reserved = memory_in_use(self._device)
        memory = ""
        if allocated is not None:
            memory = f"; after cleanup allocated {format_bytes(allocated)}, reserved {format_bytes(reserved or 0)}"
        where = failure.splitlines()[0] if failure else "on another rank"
        logger.warning("out of memory (%s); pieces of %d -> %d samples, replaying %d micro-batch(es) of this "
                       "accumulation window%s", where, size, max(1, size // 2), len(self._window), memory)

    def _floor_error(self, failure: str | None) -> Exception:
        if failure is None:
            return RankAgreementError(
                "Another rank failed: out of memory in pieces of one sample, or an error that was not an OOM (see "
                "its log). This rank stopped with it so that no rank waits for the others."
            )
        return StepOOMError(
            f"Out of memory even in pieces of 1 sample ({failure.splitlines()[0]}). Nothing of this accumulation "
            "window was applied. Run `memfit explain` to see what fills memory; then try bf16, activation "
            "checkpointing, a smaller optimizer state, or shorter inputs."
        )

