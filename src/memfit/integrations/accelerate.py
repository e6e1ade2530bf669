"""A drop-in for Accelerate's ``find_executable_batch_size`` that keeps the effective batch and the ranks together.

Accelerate's decorator halves the batch after an OOM and runs the decorated training function again, so the
effective batch halves too (transformers PR #33281 is open about it), and under DDP one rank's OOM leaves the
others waiting in a gradient all-reduce. This one halves the micro-batch and doubles the accumulation, so
``batch_size × gradient_accumulation_steps`` stays what it started as, and passes both to the function::

    from memfit.integrations.accelerate import find_executable_batch_size

    @find_executable_batch_size(starting_batch_size=64, accelerator=accelerator)
    def train(batch_size, gradient_accumulation_steps):
        accelerator.free_memory()
        loader = DataLoader(dataset, batch_size=batch_size)
        model, optimizer, loader = accelerator.prepare(build_model(), build_optimizer(), loader)
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                optimizer.step()
                optimizer.zero_grad()

    train()

With ``accelerator``, it also sets ``accelerator.gradient_accumulation_steps`` before each attempt (what
``accumulate`` and ``backward`` read), and under several processes the ranks agree: while the function runs,
``accelerator.backward`` asks every rank, before and after each backward, whether one ran out of memory (one
small all-reduce through Accelerate's ``reduce``), and DDP models prepared inside reduce their gradients only
after the ranks agreed (DDP's own reducer is held off, so no rank waits in it for a rank that failed). Every rank
then leaves the function and runs it again at the same smaller size. A collective of your own between a forward
and its backward (a ``gather`` of the loss) is not covered: move it after ``backward``.

As with Accelerate's decorator, the function runs again from its start: build the model, optimizer and data
inside it (or reload them) so that the run after an OOM starts where the first one did.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch.nn.parallel import DistributedDataParallel

from memfit.errors import RankAgreementError, StepOOMError, UsageError
from memfit.guard.agreement import reduce_gradients
from memfit.guard.oom import is_oom
from memfit.plan.search import divisors

try:
    import accelerate  # noqa: F401  (the integration's dependency: fail here, with the extra named)
except ImportError as exc:
    from memfit.errors import MissingExtraError

    raise MissingExtraError(
        "memfit's Accelerate integration needs accelerate >= 0.30, which is not installed. Install it with: "
        "pip install 'memfit[integrations]'"
    ) from exc

__all__ = ["find_executable_batch_size"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class _PeerOutOfMemory(Exception):
    """Raised on a rank that is fine when another rank ran out of memory: it leaves the function too."""


def _next_size(micro: int, effective: int) -> int:
    """The largest divisor of ``effective`` up to half of ``micro`` (0 when ``micro`` is 1)."""
    return max((d for d in divisors(effective) if d <= micro // 2), default=0)


class _RankAgreement:
    """While the function runs: the check around each backward, and DDP's reduction held until it passed."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator
        self.ddp_models: list[DistributedDataParallel] = []

    def any(self, flag: bool) -> bool:
        device = self.accelerator.device
        total = self.accelerator.reduce(torch.tensor([float(flag)], device=device), reduction="sum")
        return bool(total.item() > 0)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        acc = self.accelerator
        prepare, backward = acc.prepare, acc.backward

        def guarded_prepare(*objects: Any, **kwargs: Any) -> Any:
            out = prepare(*objects, **kwargs)
            for obj in out if isinstance(out, tuple) else (out,):
                if isinstance(obj, DistributedDataParallel):
                    obj.require_backward_grad_sync = False  # reduced by hand once the ranks agreed
                    self.ddp_models.append(obj)
            return out

        def guarded_backward(loss: torch.Tensor, **kwargs: Any) -> Any:
            if self.any(False):  # a rank ran out of memory in this micro-batch's forward
                raise _PeerOutOfMemory()
            result = backward(loss, **kwargs)
            if self.any(False):  # ... or in its backward
                raise _PeerOutOfMemory()
            if acc.sync_gradients:
                for ddp in self.ddp_models:
                    # what DDP's reducer would have done: the mean over the ranks
                    reduce_gradients(ddp.module.parameters(), ddp.process_group,
                                     factor=1.0 / ddp.process_group.size())
            return result

        vars(acc)["prepare"], vars(acc)["backward"] = guarded_prepare, guarded_backward
        try:
            yield
        finally:
            for name in ("prepare", "backward"):
                vars(acc).pop(name, None)
            for ddp in self.ddp_models:
                ddp.require_backward_grad_sync = True
            self.ddp_models.clear()


def find_executable_batch_size(
    function: Callable[..., T] | None = None,
    *,
    starting_batch_size: int = 128,
    starting_accumulation_steps: int = 1,
    accelerator: Any = None,
) -> Any:
    """Run ``function(batch_size, gradient_accumulation_steps, ...)``; after an OOM, again at half the micro-batch.

    Args:
        function: The training function; called with the micro-batch size and the accumulation steps first.
        starting_batch_size: The micro-batch to try first.
        starting_accumulation_steps: Its accumulation; ``starting_batch_size × starting_accumulation_steps`` is
            the effective batch every attempt keeps (micro-batches are divisors of it).
        accelerator: The ``accelerate.Accelerator`` the function uses: its ``gradient_accumulation_steps`` is set
            for each attempt, its memory freed between attempts, and under several processes the ranks agree.

    Returns:
        The decorated function (or a decorator, without ``function``): it returns what ``function`` returns.

    Raises:
        StepOOMError: Out of memory even at a micro-batch of 1 (on any rank).
        RankAgreementError: Another rank failed with an error that was not an OOM.
    """
    for name, value in (("starting_batch_size", starting_batch_size),
                        ("starting_accumulation_steps", starting_accumulation_steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{name} must be a positive integer, got {value!r}.")
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 starting_accumulation_steps=starting_accumulation_steps, accelerator=accelerator)
    effective = starting_batch_size * starting_accumulation_steps

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> T:
        agreement = _RankAgreement(accelerator) if accelerator is not None and accelerator.num_processes > 1 else None
        micro = starting_batch_size
        while True:
            steps = effective // micro
            if accelerator is not None:
                accelerator.gradient_accumulation_steps = steps
            failure, own = None, False
            try:
                with agreement.installed() if agreement is not None else contextlib.nullcontext():
                    result = function(micro, steps, *args, **kwargs)
                # a rank that finished must still hear about an OOM on a rank that did not
                if agreement is None or not agreement.any(False):
                    return result
                failure = "another rank ran out of memory after this one's last backward"
            except _PeerOutOfMemory:
                failure = "another rank ran out of memory"
            except Exception as exc:
                if not is_oom(exc):
                    if agreement is not None:  # both rounds, so no rank waits for this one
                        agreement.any(True)
                        agreement.any(True)
                    raise
                failure, own = f"{type(exc).__name__}: {exc}".splitlines()[0], True
            if agreement is not None:
                if own:
                    agreement.any(True)  # the round the other ranks are in: their check around a backward
                if agreement.any(False):  # round 2: did a rank fail with something that was not an OOM?
                    raise RankAgreementError("Another rank failed with an error that was not an out-of-memory "
                                             "error (see its log); this rank stopped with it.")
            _free(accelerator)
            smaller = _next_size(micro, effective)
            if smaller == 0:
                raise StepOOMError(f"Out of memory even at a micro-batch of 1 ({failure}). Run `memfit explain` "
                                   "to see what fills memory; then try bf16, activation checkpointing, a smaller "
                                   "optimizer state, or shorter inputs.")
            logger.warning("out of memory (%s); micro-batch %d -> %d, accumulation %d -> %d (effective batch %d)",
                           failure, micro, smaller, steps, effective // smaller, effective)
            micro = smaller

    return run


def _free(accelerator: Any) -> None:
    """Drop what the failed attempt left: Accelerate's references to prepared objects, garbage, cached blocks."""
    if accelerator is not None:
        accelerator.free_memory()  # also resets its accumulation step counter for the next attempt
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
