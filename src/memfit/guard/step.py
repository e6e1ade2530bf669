"""A training step that survives CUDA out-of-memory with the same gradients and no lost samples.

``TrainStep`` takes one effective batch per call, cuts it into micro-batches, accumulates their gradients with
each loss weighted by its share of samples (or tokens), and calls ``optimizer.step()`` once. When forward,
loss or backward runs out of memory it puts back everything the failed attempt changed (gradients, BatchNorm
statistics, RNG states, GradScaler stage), halves the micro-batch and runs the same batch again. Once
``optimizer.step()`` has begun nothing is retried. Under DDP the ranks agree on every attempt through a gloo
side channel before any gradient is reduced (``memfit.guard.agreement``). See ``docs/guard.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from memfit._torch_private import BatchNormBase
from memfit.errors import NumericsError, OptimizerStepOOMError, RankAgreementError, StepOOMError, UsageError
from memfit.guard import microbatch
from memfit.guard.agreement import FATAL, OK, OOM, RankChannel, Report, broadcast_buffers, reduce_gradients
from memfit.guard.numerics import LossWatch
from memfit.guard.oom import is_oom
from memfit.guard.rollback import Snapshot, memory_in_use, resolve_device
from memfit.guard.sizing import UNBOUNDED, MicroBatchSizer
from memfit.records import NOT_IN_JSON, JsonRecord
from memfit.units import format_bytes
from memfit.workload.spec import PRECISIONS, Precision, default_forward

__all__ = ["GuardConfig", "StepMetrics", "TrainStep"]

logger = logging.getLogger(__name__)

NonFinitePolicy = Literal["raise", "skip", "ignore"]

_SCHEMA = 1


@dataclass(frozen=True, kw_only=True)
class GuardConfig:
    """How a :class:`TrainStep` runs. Every field is a keyword argument of ``TrainStep``."""

    precision: Precision = "fp32"
    """Autocast dtype for forward and loss: "fp32" (no autocast), "bf16", or "fp16" (adds a GradScaler)."""
    micro_batch_size: int | None = None
    """Samples per micro-batch to start with; None starts with the whole batch. Costs: smaller is slower."""
    max_grad_norm: float | None = None
    """Clip the global gradient norm to this value after accumulation (and after unscaling for fp16)."""
    grow_after: int | None = None
    """After this many steps without OOM, try doubling the micro-batch if measured headroom says it fits;
    never to a size that ran out of memory for the same input shape. None: never grow. On CUDA this resets the
    peak-memory statistics at every step."""
    on_nonfinite: NonFinitePolicy = "raise"
    """What to do with a NaN/inf loss: raise NumericsError, skip the step, or ignore. "raise" and "skip" copy
    one flag to the host per step, queued after the last forward so that the GPU does not wait for it."""
    agree_timeout_s: float = 300.0
    """Distributed only: how long a rank waits for the others before raising RankAgreementError."""

    def __post_init__(self) -> None:
        if not isinstance(self.precision, str) or self.precision not in PRECISIONS:
            raise UsageError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}.")
        for name in ("micro_batch_size", "grow_after"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not hasattr(type(value), "__index__"):
                raise UsageError(f"{name} must be an integer of at least 1, or None, got {value!r}.")
            if operator.index(value) < 1:
                raise UsageError(f"{name} must be at least 1 or None, got {value}.")
            object.__setattr__(self, name, operator.index(value))
        for name in ("max_grad_norm", "agree_timeout_s"):
            value = getattr(self, name)
            if value is None and name == "max_grad_norm":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(type(value), "__float__"):
                raise UsageError(f"{name} must be a positive number, got {value!r}.")
            if not float(value) > 0:  # also NaN
                raise UsageError(f"{name} must be positive{' or None' if name == 'max_grad_norm' else ''}, "
                                 f"got {value}.")
        if not isinstance(self.on_nonfinite, str) or self.on_nonfinite not in ("raise", "skip", "ignore"):
            raise UsageError(f"on_nonfinite must be 'raise', 'skip' or 'ignore', got {self.on_nonfinite!r}.")


@dataclass(frozen=True, kw_only=True)
class StepMetrics(JsonRecord):
    """What one guarded step did. ``loss`` and ``grad_norm`` sync with the device only when read."""

    _schema: ClassVar[int] = _SCHEMA
    # the tensors stay on the device; the JSON carries their values (reading them syncs)
    _json_properties: ClassVar[tuple[str, ...]] = ("loss", "grad_norm")

    step: int
    """Optimizer steps taken before this one (0 for the first step)."""
    micro_batch_size: int
    """Samples per micro-batch in the attempt that succeeded."""
    micro_batches: int
    """Micro-batches in that attempt."""
    samples: int
    """Units (samples, or tokens with a token count_fn) the loss averaged over on this rank."""
    ooms: int
    """Attempts of this step that ran out of memory (on any rank) and were retried."""
    skipped: bool
    """True when no update was applied: non-finite loss with on_nonfinite="skip", or GradScaler found inf/NaN."""
    skip_reason: str | None
    """Why the step was skipped, if it was."""
    loss_tensor: torch.Tensor | None = field(metadata=NOT_IN_JSON)
    """This rank's batch loss (the weighted sum of micro-batch losses), detached, on the device."""
    grad_norm_tensor: torch.Tensor | None = field(metadata=NOT_IN_JSON)
    """Global gradient norm before clipping, when max_grad_norm is set."""

    @property
    def loss(self) -> float:
        """The batch loss as a float (a host sync)."""
        return float("nan") if self.loss_tensor is None else float(self.loss_tensor)

    @property
    def grad_norm(self) -> float | None:
        """The gradient norm before clipping as a float (a host sync), or None without clipping."""
        return None if self.grad_norm_tensor is None else float(self.grad_norm_tensor)


@dataclass(frozen=True)
class _Failure:
    """Where an attempt ran out of memory: text only, so no frame or tensor outlives the except block."""

    phase: str
    index: int
    message: str
    allocated_bytes: int | None
    reserved_bytes: int | None


def _count(value: Any, name: str, least: int = 0) -> int:
    """An integer field of a saved state, checked."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__") or operator.index(value) < least:
        raise ValueError(f"{name} must be an integer of at least {least}, got {value!r}")
    return operator.index(value)


class TrainStep:
    """One optimizer step per call, split into micro-batches, retried at a smaller size after an OOM.

    Args:
        model: The model, or a ``DistributedDataParallel`` wrapping it (then the ranks agree every step).
        optimizer: Optimizer over the model's parameters; TrainStep owns ``zero_grad`` and ``step``.
        loss_fn: ``loss_fn(output, micro_batch) -> scalar``, a *mean* over the micro-batch's samples (or over
            its tokens, with ``count_fn=memfit.count_tokens(...)``).
        forward_fn: ``forward_fn(module, micro_batch) -> output``. Default: ``module(mb)`` for a tensor,
            ``module(mb[0])`` for a tuple/list, ``module(**mb)`` for a dict.
        splitter: How to size and cut custom batches (:class:`memfit.guard.microbatch.BatchSplitter`).
        count_fn: Units each micro-batch loss is a mean over; default: its number of samples.
        scaler: A GradScaler to use with precision "fp16" (default: a new one, saved in ``state_dict``).
        device: Move each micro-batch here just before its forward (the batch itself may stay on the host).
        process_group: Data-parallel group for a model that is not DDP but whose gradients must be reduced.
        **config: The fields of :class:`GuardConfig`.

    Example:
        >>> model = nn.Linear(4, 1)
        >>> step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
        ...                  lambda out, mb: nn.functional.mse_loss(out, mb[1]), micro_batch_size=2)
        >>> step((torch.randn(5, 4), torch.randn(5, 1))).micro_batches
        3
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        *,
        forward_fn: Callable[[nn.Module, Any], Any] | None = None,
        splitter: microbatch.BatchSplitter | None = None,
        count_fn: microbatch.CountFn | None = None,
        scaler: torch.amp.GradScaler | None = None,
        device: torch.device | str | None = None,
        process_group: Any = None,
        **config: Any,
    ) -> None:
        unknown = sorted(set(config) - {f.name for f in dataclasses.fields(GuardConfig)})
        if unknown:
            raise UsageError(f"TrainStep got unknown keyword argument(s) {', '.join(unknown)}; it takes forward_fn, "
                             "splitter, count_fn, scaler, device, process_group and the fields of GuardConfig.")
        self.config = GuardConfig(**config)
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.forward_fn = forward_fn or default_forward
        self.splitter: microbatch.BatchSplitter = splitter or microbatch.TensorSplitter()
        self.count_fn = count_fn or self.splitter.size
        # "cuda" becomes "cuda:<current>" here, once: several CUDA calls reject a device without an index.
        self.device = resolve_device(device) if device is not None else None
        # Under DDP, micro-batches call the wrapped module directly: no reducer hooks, no buffer broadcast,
        # so nothing inside a micro-batch is a collective (see _distributed_agree).
        self._ddp = model if isinstance(model, DistributedDataParallel) else None
        self._module: nn.Module = self._ddp.module if self._ddp is not None else model
        self._channel: RankChannel | None = None
        group = self._ddp.process_group if self._ddp is not None else process_group
        if self._ddp is not None or process_group is not None:
            channel = RankChannel(group, timeout_s=self.config.agree_timeout_s)
            self._channel = channel if channel.world_size > 1 else None
        self._group = group
        param = next(self._module.parameters(), None)
        self._param_device = resolve_device(param.device) if param is not None else torch.device("cpu")
        self._run_device = self.device or self._param_device
        self._owns_scaler = scaler is None and self.config.precision == "fp16"
        if scaler is not None and self.config.precision != "fp16":
            raise UsageError(f"A GradScaler is only used with precision='fp16', not {self.config.precision!r}.")
        self.scaler = scaler or (torch.amp.GradScaler(self._run_device.type) if self._owns_scaler else None)
        self._snapshot: Snapshot | None = None
        self._watch = LossWatch()
        # Adaptive state, all in state_dict().
        self._sizer = MicroBatchSizer(self.config.micro_batch_size, self.config.grow_after, self._run_device)
        self.steps = 0
        self.total_ooms = 0
        self.skipped_steps = 0
        if any(isinstance(m, BatchNormBase) for m in self._module.modules()):
            logger.warning(
                "The model has BatchNorm layers. Their batch statistics are computed per "
                "micro-batch, so results depend on the micro-batch size; the guard restores running statistics "
                "after an OOM but cannot make them equal to a whole-batch pass. GroupNorm/LayerNorm avoid this."
            )

    @property
    def micro_batch_size(self) -> int | None:
        """The current micro-batch size (None: the whole batch), agreed by all ranks."""
        return self._sizer.size

    # -- the step ---------------------------------------------------------------------------------------------

    def __call__(self, batch: Any) -> StepMetrics:
        """Train on one effective batch: accumulate over micro-batches, then one optimizer step.

        Raises:
            StepOOMError: Out of memory even at micro-batch size 1 (on any rank). Nothing was applied.
            OptimizerStepOOMError: Out of memory inside ``optimizer.step()``; not retried.
            NumericsError: A non-finite loss with ``on_nonfinite="raise"``. Nothing was applied.
            RankAgreementError: Another rank failed or did not answer in time.
        """
        if self._snapshot is None:
            self._snapshot = Snapshot(self._module, self._run_device)  # dropout draws from the run device's RNG
        n_batch = self.splitter.size(batch)
        key_fn = getattr(self.splitter, "shape_key", None)
        key = key_fn(batch) if key_fn is not None else ()
        self._zero_grads()  # set_to_none: no gradient memory until the first backward of this step
        self._snapshot.take()
        baseline_bytes = None
        if self._sizer.measures_headroom:
            baseline_bytes = torch.cuda.memory_allocated(self._run_device.index)
            torch.cuda.reset_peak_memory_stats(self._run_device.index)
        ooms = 0
        while True:
            # a rank with no samples reports the size the others run at, so every rank's metrics agree
            size = self._sizer.size_for(n_batch) if n_batch > 0 else (self._sizer.size or 0)
            # an empty batch (the last shard of an epoch on some rank) is a step of zero samples: nothing to run,
            # but the rank still reports, so under DDP the others do not wait for it until the timeout
            micro_batches = self.splitter.split(batch, size) if n_batch > 0 else []
            counts = self._counts(micro_batches)
            samples = sum(counts)
            weights = [c / samples if samples else 0.0 for c in counts]
            failure, losses, loss_index = self._attempt(micro_batches, weights)
            del micro_batches  # views of the batch, or host objects; nothing device-side survives the attempt
            nonfinite_index = self._nonfinite_index(loss_index) if failure is None else None
            if failure is not None:
                proposal = self._sizer.shrink_proposal(key, size)  # 0: already at 1, cannot split further
            elif n_batch == 0:
                proposal = self._sizer.size if self._sizer.size is not None else UNBOUNDED  # no news on memory
            else:
                proposal = self._sizer.keep_or_grow_proposal(key, size, n_batch, baseline_bytes)
            reports = self._agree(
                Report(
                    status=OK if failure is None else OOM,
                    samples=samples,
                    proposed_size=proposal,
                    nonfinite=nonfinite_index is not None,
                )
            )
            fatal = [i for i, r in enumerate(reports) if r.status == FATAL]
            if fatal:
                self._zero_grads()
                raise RankAgreementError(
                    f"Rank(s) {fatal} failed with an error that is not an out-of-memory during step {self.steps}; "
                    "this rank stops too rather than wait. The cause is in the log of the failing rank."
                )
            if not any(r.status == OOM for r in reports):
                break
            # Recovery, outside any except block: the failed attempt's frames are gone, so are its tensors.
            ooms += 1
            self.total_ooms += 1
            self._sizer.clean_steps = 0  # on every rank, so that all ranks keep counting alike
            self._zero_grads()
            # GradScaler needs nothing put back: during micro-batches it only multiplies losses; its scale and
            # per-optimizer stage change in unscale_/step/update, which run after the last retry point.
            self._snapshot.restore()
            new_size = min(r.proposed_size for r in reports)
            self._log_shrink(failure, reports, size, new_size, len(counts))
            if new_size == 0:
                raise self._floor_error(failure, reports)
            self._sizer.apply_shrink(new_size)
        return self._finish(
            reports=reports,
            losses=losses,
            nonfinite_index=nonfinite_index,
            shape=(size, len(counts), samples, ooms),
        )

    def _attempt(
        self, micro_batches: Any, weights: list[float]
    ) -> tuple[_Failure | None, list[torch.Tensor], list[int]]:
        """Forward, loss and backward of every micro-batch; returns where it ran out of memory, if it did.

        Also returns the weighted losses and the index of the micro-batch each came from.
        """
        losses: list[torch.Tensor] = []
        loss_index: list[int] = []
        last = max((i for i, w in enumerate(weights) if w != 0.0), default=-1)
        watch = self.config.on_nonfinite != "ignore"
        phase, index, failure = "forward", 0, None
        no_sync = self._ddp.no_sync() if self._ddp is not None else contextlib.nullcontext()
        try:
            with no_sync:
                for index, (mb, weight) in enumerate(zip(micro_batches, weights)):
                    if weight == 0.0:
                        continue  # nothing counted (all tokens ignored): contributes nothing, skip the work
                    if self.device is not None:
                        mb = microbatch.to_device(mb, self.device)
                    phase = "forward"
                    with self._autocast():
                        output = self.forward_fn(self._module, mb)
                        phase = "loss"
                        loss = self.loss_fn(output, mb)
                    # Drop the output before backward: what backward needs is held by the graph, and the rest
                    # (the logits of a language model) would sit on top of the backward peak. memfit.plan
                    # predicts this loop (Workload.keep_output=False).
                    del output
                    phase = "backward"
                    # weight = this micro-batch's share of the batch's samples (or tokens): sum = batch mean
                    scaled = loss * weight
                    if self.scaler is not None:
                        scaled = self.scaler.scale(scaled)
                    losses.append(loss.detach().float() * weight)
                    loss_index.append(index)
                    if watch and index == last:
                        # Every loss exists now: queue their finiteness check before the last backward, so its
                        # copy to the host completes while the GPU runs that backward (see memfit.guard.numerics).
                        self._watch.record(losses)
                    scaled.backward()
                    del loss, scaled, mb
        except Exception as exc:
            if not is_oom(exc):
                self._announce_fatal()
                raise
            allocated, reserved = memory_in_use(self._run_device)
            failure = _Failure(phase, index, f"{type(exc).__name__}: {exc}", allocated, reserved)
        # A failed attempt returns nothing device-side, so memory is back at the pre-step baseline on return.
        if failure is not None:
            self._watch.clear()
            return failure, [], []
        return failure, losses, loss_index

    def _finish(
        self,
        *,
        reports: list[Report],
        losses: list[torch.Tensor],
        nonfinite_index: int | None,
        shape: tuple[int, int, int, int],
    ) -> StepMetrics:
        """Everything after the ranks agreed the attempt succeeded: reduce, clip, step. Never retried."""
        size, micro_batches, samples, ooms = shape
        step = self.steps
        loss = torch.stack(losses).sum() if losses else None
        global_samples = sum(r.samples for r in reports)
        skip_reason = None

        def metrics(reason: str | None, grad_norm: torch.Tensor | None) -> StepMetrics:
            return StepMetrics(step=step, micro_batch_size=size, micro_batches=micro_batches, samples=samples,
                               ooms=ooms, skipped=reason is not None, skip_reason=reason, loss_tensor=loss,
                               grad_norm_tensor=grad_norm)

        if any(r.nonfinite for r in reports):
            where = [i for i, r in enumerate(reports) if r.nonfinite]
            text = f"Non-finite loss at step {step}"
            if nonfinite_index is not None:
                text += f" in micro-batch {nonfinite_index + 1} of {micro_batches}"
            if self._channel is not None:
                text += f" (on ranks {where}; this is rank {self._channel.rank})"
            text += f", micro-batch size {size}."
            self._zero_grads()
            if self.config.on_nonfinite == "raise":
                raise NumericsError(text + " Nothing was applied. Lower the learning rate, use bf16, or pass "
                                    "on_nonfinite='skip' to drop such batches.")
            skip_reason = text
        elif global_samples == 0:
            self._zero_grads()
            skip_reason = "no samples (or no counted tokens) on any rank"
        if skip_reason is not None:
            logger.warning("skipping step %d: %s", self.steps, skip_reason)
            self.skipped_steps += 1
            return metrics(skip_reason, None)
        if self._channel is not None:
            # SUM of (local samples / global samples) * local mean gradient = gradient of the global mean.
            reduce_gradients(self._module.parameters(), self._group, factor=samples / global_samples)
        scale_before = self.scaler.get_scale() if self.scaler is not None else None
        # From here on nothing is retried: after an all-reduce, a retry would need a second agreement round,
        # and once optimizer.step() began the parameters may be half-updated.
        phase, failure, grad_norm = "clipping gradients", None, None
        try:
            grad_norm = self._clip()
            phase = "optimizer.step()"
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
            else:
                self.optimizer.step()
        except Exception as exc:
            if not is_oom(exc):
                raise
            failure = f"{type(exc).__name__}: {exc}"
        if failure is not None:
            applied = ("nothing was applied" if phase == "clipping gradients"
                       else "the update may have reached some parameters only")
            raise OptimizerStepOOMError(
                f"Out of memory while {phase} at step {step} ({failure.splitlines()[0]}); {applied}, so it is "
                "not retried. The gradients, the GradScaler and the guard's counters are left as they were. "
                "Reload the last checkpoint and make the optimizer fit: create its state before training, use "
                "foreach=False (smaller temporaries), or run `memfit explain`."
            )
        if self.scaler is not None:
            self.scaler.update()
            if scale_before is not None and self.scaler.get_scale() < scale_before:
                skip_reason = "GradScaler found inf/NaN gradients; the update was skipped and the scale lowered"
                self.skipped_steps += 1
        if self._ddp is not None and self._ddp.broadcast_buffers:
            broadcast_buffers(self._module, self._group)  # what DDP's forward would have done
        self.steps += 1
        self._sizer.apply_success(min(r.proposed_size for r in reports))
        return metrics(skip_reason, grad_norm)

    # -- helpers ----------------------------------------------------------------------------------------------

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.config.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.config.precision == "bf16" else torch.float16
        return torch.autocast(self._run_device.type, dtype=dtype)

    def _params(self) -> Iterator[nn.Parameter]:
        return (p for p in self._module.parameters() if p.requires_grad)

    def _zero_grads(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for p in self._module.parameters():
            p.grad = None

    def _counts(self, micro_batches: Any) -> list[int]:
        raw = [self.count_fn(mb) for mb in micro_batches]
        if any(isinstance(c, torch.Tensor) for c in raw):
            # one host sync for all micro-batches, before the first forward
            return [int(c) for c in torch.stack([torch.as_tensor(c).reshape(()) for c in raw]).tolist()]
        return [int(c) for c in raw]

    def _nonfinite_index(self, loss_index: list[int]) -> int | None:
        """The micro-batch whose loss is not finite, or None; waits only for the copy queued before backward."""
        if self.config.on_nonfinite == "ignore" or not loss_index:
            return None
        finite = self._watch.all_finite()
        position = None if finite else self._watch.first_nonfinite()
        self._watch.clear()
        return None if position is None else loss_index[position]

    def _clip(self) -> torch.Tensor | None:
        if self.config.max_grad_norm is None:
            return None
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
        return nn.utils.clip_grad_norm_(list(self._params()), self.config.max_grad_norm)

    def _agree(self, report: Report) -> list[Report]:
        return [report] if self._channel is None else self._channel.exchange(report)

    def _announce_fatal(self) -> None:
        """Tell the other ranks this one is failing, so they raise instead of waiting for the timeout."""
        if self._channel is not None:
            with contextlib.suppress(RankAgreementError):
                self._channel.exchange(Report(status=FATAL, samples=0, proposed_size=0, nonfinite=False))

    def _log_shrink(self, failure: _Failure | None, reports: list[Report], size: int, new_size: int,
                    n_micro: int) -> None:
        ranks = [i for i, r in enumerate(reports) if r.status == OOM]
        where = (f"{failure.phase} of micro-batch {failure.index + 1}/{n_micro}" if failure is not None
                 else f"rank(s) {ranks}")
        allocated, reserved = memory_in_use(self._run_device)
        memory = ""
        if failure is not None and failure.allocated_bytes is not None:
            memory = (f"; at the OOM allocated {format_bytes(failure.allocated_bytes)}, reserved "
                      f"{format_bytes(failure.reserved_bytes or 0)}; after cleanup allocated "
                      f"{format_bytes(allocated or 0)}, reserved {format_bytes(reserved or 0)}")
        rank = f" (rank {self._channel.rank}, OOM on ranks {ranks})" if self._channel is not None else ""
        logger.warning("out of memory in %s at step %d%s; micro-batch size %d -> %s%s",
                       where, self.steps, rank, size, new_size or "none (already 1)", memory)

    def _floor_error(self, failure: _Failure | None, reports: list[Report]) -> StepOOMError:
        summary = ""
        if self._run_device.type == "cuda":
            summary = "\n" + torch.cuda.memory_summary(self._run_device.index, abbreviated=True)
        origin = (f"{failure.phase} of micro-batch {failure.index + 1}: {failure.message.splitlines()[0]}"
                  if failure is not None else
                  f"on rank(s) {[i for i, r in enumerate(reports) if r.proposed_size == 0]}")
        return StepOOMError(
            f"Out of memory at step {self.steps} even with micro-batches of 1 sample ({origin}). Nothing was "
            "applied and the guard cannot split further. Run `memfit explain` to see what fills memory; then "
            "try precision='bf16', activation checkpointing, a smaller optimizer state, or shorter inputs."
            + summary
        )

    # -- checkpointing ----------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The adaptive state (micro-batch size, sizes that failed, counters, owned GradScaler)."""
        return {
            "schema": _SCHEMA,
            **self._sizer.state_dict(),
            "steps": self.steps,
            "total_ooms": self.total_ooms,
            "skipped_steps": self.skipped_steps,
            "scaler": self.scaler.state_dict() if self._owns_scaler and self.scaler is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next step starts at the remembered micro-batch size.

        Raises:
            UsageError: ``state`` is not a whole TrainStep state of this schema (nothing is changed then).
        """
        if not isinstance(state, dict):
            raise UsageError(f"TrainStep.load_state_dict takes the dict of TrainStep.state_dict(), got "
                             f"{type(state).__name__}.")
        if state.get("schema") != _SCHEMA:
            raise UsageError(f"TrainStep state has schema {state.get('schema')!r}; this memfit reads {_SCHEMA}.")
        missing = [k for k in self.state_dict() if k not in state]
        if missing:
            raise UsageError(f"TrainStep state is missing {', '.join(missing)}: pass the whole dict that "
                             "TrainStep.state_dict() returned (a partial state would resume half the guard).")
        try:
            counters = {k: _count(state[k], k) for k in ("steps", "total_ooms", "skipped_steps", "clean_steps")}
            size = state["micro_batch_size"]
            if size is not None:
                _count(size, "micro_batch_size", least=1)
            for key, n in state["failed_sizes"]:
                _count(n, "failed_sizes", least=1)
                for shape in key:
                    for extent in shape:
                        _count(extent, "a failed_sizes shape")
        except (TypeError, ValueError) as exc:
            raise UsageError(f"TrainStep state is malformed: {exc}. Pass the dict TrainStep.state_dict() "
                             "returned.") from None
        self._sizer.load_state_dict(state)
        self.steps = counters["steps"]
        self.total_ooms = counters["total_ooms"]
        self.skipped_steps = counters["skipped_steps"]
        if state.get("scaler") is not None and self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
