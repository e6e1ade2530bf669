"""What a trace knows of the step's tensor values, and its answer wherever values decide what the step does.

Fake tensors have shapes and no values. The recorder (``memfit.estimate.recorder``) asks ``StepValues`` at the
three places where values matter: an op whose output size depends on them (``nonzero``, a boolean mask), a value
read as a number or a condition (``.item()``, ``bool()``), and after every op, to follow what it learnt (the
values of small tensors made from constants, which storages hold the model's values or a random draw's). The
answers come, in this order, from known values (``memfit.estimate.values``), from a proof or the batch's values
(``memfit.estimate.data_dependent``), from one real CPU forward of the first step (``RealForward``), and last
from a request to trace again with values (``ValuesNeededToTrace``) or a read taken as 0, said in ``uncertain``.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from typing import Any, Protocol

import torch

from memfit import _torch_private as tp
from memfit.estimate import values
from memfit.estimate.bound import UncertaintyReason
from memfit.estimate.branch_checks import int_of_item, only_checks
from memfit.estimate.data_dependent import (
    SMALL_MASK_BYTES,
    IndexBounds,
    MaskCounts,
    ProductStandIns,
    RealForward,
    is_dynamic,
    size_from_known_values,
)
from memfit.estimate.trace_record import Trace, output_tensors
from memfit.estimate.value_reads import (
    CONDITION,
    RANDOM_OPS,
    ValuesNeededToTrace,
    draw_range,
    in_initializer,
    reads,
    user_frame,
    user_location,
    where,
)

log = logging.getLogger(__name__)

__all__ = ["NOT_KNOWN", "StepValues", "fake_like"]

DRAW_WARNING = "a random draw of the step deciding a branch"
"""How the warning about conditions on random draws (LayerDrop) begins: said once per trace."""

NOT_KNOWN = object()
"""``StepValues.known_read``'s answer when the value read is not known before the op runs."""


class _Recording(Protocol):
    """What ``StepValues`` reads of the recorder: where in the step the trace is."""

    trace: Trace
    phase: str
    module_stack: list[str]
    building_model: bool


def fake_like(real: Any) -> Any:
    """Fake tensors (the fake mode is the next one down) of ``real``'s shapes, strides and dtypes."""
    if isinstance(real, torch.Tensor):
        return torch.empty_strided(real.shape, real.stride(), dtype=real.dtype)
    if isinstance(real, (list, tuple)):
        return type(real)(fake_like(r) for r in real)
    return real


class StepValues:
    """The values one trace follows and the answers it gives where values decide the step (module docstring)."""

    def __init__(self, recording: _Recording, *, real: bool, batch_values: bool,
                 real_forward: RealForward | None) -> None:
        self._recording = recording
        self.real = real
        """Tracing real CPU tensors (a step whose sizes depend on data values), not fake ones."""
        self.batch_values = batch_values
        """The batch is made for real and its values are followed too (a step whose sizes depend on the data)."""
        self.known = values.KnownValues(values.BATCH_MAX_NUMEL if batch_values else values.MAX_NUMEL)
        """Real values of the small tensors computed from constants (memfit.estimate.values)."""
        self.bounds = IndexBounds()
        self.mask_counts = MaskCounts()
        self.real_forward = real_forward
        """What the value-dependent ops of one real forward returned: kept there by a real trace, read by a fake one."""
        self.stand_ins = ProductStandIns() if real and real_forward is not None else None
        """The real forward that sizes value-dependent ops does not compute its large products (see there)."""
        self._dynamic_calls = 0  # value-dependent ops so far in this forward and loss (RealForward's order)
        self._conditions = 0  # bool() reads so far in this forward and loss (RealForward.conditions' order)
        self.host_copies = 0  # .numpy() calls so far in this forward and loss (RealForward.host_copies' order)
        self._read_sites: Counter[str] = Counter()  # number reads so far at each place in this forward and loss
        self._read_key: tuple[str, int] | None = None
        """The number read running now (``.item()`` of a non-bool tensor): its place and how many reads there came
        before it in this forward and loss (RealForward.reads' key)."""
        self._from_model: Any = tp.WeakIdKeyDictionary()
        """Storages whose values the model's parameters or buffers went into (in forward and loss): a size decided
        by them needs the real forward, not the batch's values."""
        self._drawn: Any = tp.WeakIdKeyDictionary()
        """Storages whose values a one-element random draw of forward or loss went into (``torch.rand([]) <
        layerdrop``): a condition on them takes another branch each step, so neither the batch nor one real forward
        decides it. A draw of many elements is noise on values (RT-DETR's denoising queries jitter the batch's boxes,
        and its matcher checks the predicted boxes, theirs included, with ``.all()``): a condition on it is on the
        values, which the real forward decides, as for dropout (``RANDOM_OPS``)."""
        self._draw_top: Any = tp.WeakIdKeyDictionary()
        """One-element draws of forward and loss -> the smallest and the largest value each can take
        (``draw_range``); a read as a number gets the largest, in the real forward and in the trace alike."""
        self._warned_read = False

    def begin_forward(self) -> None:
        """A forward begins: RealForward's records are numbered from here."""
        self._dynamic_calls = self._conditions = self.host_copies = 0
        self._read_sites.clear()

    def number(self, func: Any, name: str, args: Any) -> tuple[int | None, int | None]:
        """The op's place in this forward and loss among the value-dependent ops and among the conditions (the
        orders RealForward keeps), or None where it is not one; a number read's place is kept aside (``_read_key``)."""
        self._read_key = None
        if self._recording.phase not in ("forward", "loss"):
            return None, None
        call = condition = None
        if is_dynamic(func, name):
            call, self._dynamic_calls = self._dynamic_calls, self._dynamic_calls + 1
        if name == "_local_scalar_dense" and args[0].dtype == torch.bool:
            condition, self._conditions = self._conditions, self._conditions + 1
        elif name == "_local_scalar_dense":
            # numbers are matched by place, not by order: a module that reads some only in its first forward
            # (torchvision's MultiScaleRoIAlign, its scales) would shift every later read of the next step
            site = user_frame()
            self._read_key, self._read_sites[site] = (site, self._read_sites[site]), self._read_sites[site] + 1
        return call, condition

    # ------------------------------------------------------------ value reads
    def drawn_top(self, t: torch.Tensor) -> Any:
        """A one-element random draw of forward or loss read as a number: its largest value (``draw_range``), in
        the real forward and the trace alike; None for any other read."""
        if t.dtype == torch.bool or self._recording.phase not in ("forward", "loss"):
            return None
        found = self._draw_top.get(t.untyped_storage())
        if found is None:
            return None
        low, top = found
        frame = user_location()
        if not (frame is not None and frame.lineno is not None and int_of_item(frame.filename, frame.lineno)
                and math.floor(low) == math.floor(top)):
            # other draws may pick other sizes; not where the number is made an integer at once and every draw
            # gives the same one (torchvision's torch_choice over a single size: int() of a draw in [0, 1))
            site = "an unknown place" if frame is None else where(frame)
            self._recording.trace.uncertain.setdefault(
                "value_read", f"a random draw read at {site} was taken at its largest ({top}): other draws "
                "may pick smaller sizes")
        self._keep_read(top)
        return top

    def _keep_read(self, value: Any) -> None:
        """The real forward keeps what the number read running now got (``RealForward.reads``)."""
        if self.real and self._read_key is not None and self.real_forward is not None:
            self.real_forward.reads[self._read_key] = value

    def known_read(self, t: torch.Tensor, condition: int | None) -> Any:
        """``t.item()`` when ``t``'s value is known (computed from constants), else ``NOT_KNOWN``."""
        known = self.known.scalar(t)
        if known is None:
            return NOT_KNOWN
        if condition is not None and (self.batch_values or self.real_forward is not None):
            # a value from data may go another way on the user's (constants alone decide exactly: not noted)
            self._note_condition(from_values=True)
        if self.real and condition is not None and self.real_forward is not None:
            self.real_forward.conditions.append(bool(known))
        self._keep_read(known)
        return known

    def unknown_read(self, t: torch.Tensor, condition: int | None) -> Any:
        """The value a read of ``t`` gets when no value is known: what the real forward read at the same place, or
        a request to trace with values (a condition in forward), or 0, said in ``uncertain``."""
        recording = self._recording
        # GradScaler reads found_inf in the optimizer phase: 0 (no inf) is the step we want to predict
        if recording.phase == "optimizer":
            return False if t.dtype == torch.bool else (0.0 if t.is_floating_point() else 0)
        if in_initializer():
            # torch.nn.init's functions only write the values of the tensor they are given: their conditions
            # (trunc_normal_'s rejection loop asks `mask.any()`) decide which values, never which tensors exist
            return False if t.dtype == torch.bool else (0.0 if t.is_floating_point() else 0)
        if t.dtype == torch.bool and reads(self._drawn, [t]):
            # a fresh draw each step (LayerDrop's `torch.rand([]) < p`): no one run decides it. False is the draw at
            # which stochastic depth and LayerDrop skip nothing, their largest step: named, not widened (layer_drop)
            site = user_frame()
            recording.trace.uncertain.setdefault(
                "layer_drop", f"a condition on a random draw at {site} was taken as False (LayerDrop and "
                "stochastic depth then skip nothing, the largest step)")
            if not any(w.startswith(DRAW_WARNING) for w in recording.trace.warnings):
                # said apart from the bound's reason, which an earlier condition may have named first (HuBERT's
                # label check): a measured run whose draws skipped layers peaks lower, by the skipped layers' share
                # (benchmarks/results/estimate/holdout2_misses_h200_torch2.11_20261128_s24.md: +10.7 % over three steps)
                recording.trace.warnings.append(
                    f"{DRAW_WARNING} at {site} was taken as skipping nothing: memfit predicts the step in which "
                    "LayerDrop or stochastic depth drops no layer, the largest; steps that drop some need less.")
            return False
        recorded = self.real_forward.conditions if self.real_forward is not None else []
        if condition is not None and condition < len(recorded):
            self._note_condition(from_values=True)
            return recorded[condition]  # what the real forward's condition at this place in the order was
        if self._read_key is not None and self.real_forward is not None and self._read_key in self.real_forward.reads:
            # a number the step computes with (Switch Transformers formats its expert's name from one)
            recording.trace.uncertain.setdefault(
                "value_read", f"a tensor value read at {self._read_key[0]}: what one real CPU forward read there")
            return self.real_forward.reads[self._read_key]
        if t.dtype == torch.bool and recording.phase in ("forward", "loss") and self.real_forward is None \
                and not recording.building_model:
            # a condition (`if x.abs().sum() > 0:`) decides which ops run: trace again with the values that
            # decide it, as for a value-dependent size (trace_workload), rather than take a branch real data may not
            raise self.needed(CONDITION, [t])
        # a bool read is a condition (`if x.sum() > 0:`): the branch taken may not be the one real data takes, unless
        # the condition only checks the values (its other branch raises, warns or runs only on overflowed values:
        # value_check, not widened)
        reason: UncertaintyReason = "value_read"
        asked: str | None = None  # where, when _note_condition walked the stack for it already
        if t.dtype == torch.bool and recording.phase in ("forward", "loss"):
            asked, check = self._note_condition(from_values=False)
            reason = "value_check" if check else "value_branch"
        elif t.dtype == torch.bool:
            reason = "value_branch"
        if reason not in recording.trace.uncertain:
            asked = asked or user_frame()
            module = recording.module_stack[-1] if recording.module_stack else recording.phase
            recording.trace.uncertain[reason] = (
                f"a condition on tensor values at {asked} ({module}) was taken as False"
                + (" (it only checks the values: its other branch raises, warns or runs only on overflowed values)"
                   if reason == "value_check" else "")
                if t.dtype == torch.bool else f"a tensor value read at {asked} ({module}) was taken as 0")
        if not self._warned_read:
            self._warned_read = True
            msg = (
                "the step reads a tensor value with .item() or similar; fake tensors have none, so memfit used 0. "
                "Memory is right unless control flow depends on that value."
            )
            recording.trace.warnings.append(msg)
            log.warning(msg)
        if t.dtype == torch.bool:
            return False
        return 0 if not t.is_floating_point() else 0.0

    def _note_condition(self, *, from_values: bool) -> tuple[str, bool]:
        """Where the condition being read was asked, and whether it only checks the values
        (``memfit.estimate.branch_checks``; ``from_values``: answered from real values, not taken as False); kept
        in the trace's ``condition_sites``, where a site is a check only if every answer there was."""
        frame = user_location()
        if frame is None:
            return "an unknown place", False
        site = where(frame)
        check = frame.lineno is not None and only_checks(frame.filename, frame.lineno, from_values=from_values)
        sites = self._recording.trace.condition_sites
        sites[site] = sites.get(site, True) and check
        return site, sites[site]

    # ------------------------------------------------------ value-dependent sizes
    def sized_from_known(self, func: Any, name: str, args: Any, kwargs: dict[str, Any]) -> Any:
        """The output of a value-dependent op whose inputs' values are all known: a fake tensor of the real size;
        None when they are not."""
        real = self.known.run(func, name, args, kwargs)
        if real is None:
            return None
        out = fake_like(real)
        self.known.keep(out, real)
        self.mask_counts.learn(name, args, out)
        return out

    def sized_without_all_values(self, name: str, args: Any, kwargs: dict[str, Any], call: int | None) -> Any:
        """The output of a value-dependent op whose inputs' values are not all known (memfit.estimate.data_dependent):
        a provable size, a size decided by the inputs that have values, or what the real forward's op returned."""
        if name == "bincount":
            out = self.bounds.bincount(args, kwargs)
            if out is not None:
                return out
        solved = size_from_known_values(name, args, kwargs, self.known.value)
        if solved is not None:
            out, real = solved
            if real is not None:
                for f, r in zip(output_tensors(out), real if isinstance(real, (tuple, list)) else (real,)):
                    if r is not None:
                        self.known.keep(f, r)
            self._sized_by("the batch's values", name)
            return out
        found = self.real_forward.lookup(call, name, args) if call is not None and self.real_forward else None
        if found is None:  # a mask sized in forward indexes again in backward (``x[mask] = v``)
            counted = self.mask_counts.index(name, args)
            if counted is None and self._recording.phase in ("forward", "loss") and self.reads_model(args[1:]):
                counted = self.mask_counts.largest(name, args, SMALL_MASK_BYTES)
                if counted is not None:
                    self._recording.trace.uncertain.setdefault(
                        "data_dependent_shape", f"{name} at {user_frame()}: a small mask of the model's values taken "
                        "at its largest")
            return counted
        outs: list[Any] = [None if t is None else fake_like(t) for t in found.outputs]
        for f, r in zip(outs, found.outputs):
            if f is not None and r is not None and r.device.type != "meta":
                self.known.keep(f, r)
        self._sized_by("one real CPU forward", name)
        return tuple(outs) if found.multiple else outs[0]

    def _sized_by(self, source: str, name: str) -> None:
        """Note that a value-dependent size came from ``source`` (a retry's values): the bound widens for it
        (``trace_workload``'s message replaces this one where such a size caused the retry)."""
        self._recording.trace.uncertain.setdefault("data_dependent_shape",
                                                   f"{name} at {user_frame()}: sizes from {source}")

    def needed(self, op: str, deciding: Any) -> ValuesNeededToTrace:
        """The request to trace again with values, for ``op`` whose answer the tensors ``deciding`` decide."""
        return ValuesNeededToTrace(op, user_frame(), self.reads_model(deciding), self.param_bytes())

    # ---------------------------------------------------------------- after ops
    def follow(self, func: Any, name: str, args: Any, kwargs: dict[str, Any], out: Any, call: int | None,
               condition: int | None) -> None:
        """Learn what the op just run tells of values: the real forward's records, the known values of small
        outputs, index bounds, and which outputs hold the model's values or a random draw's."""
        phase = self._recording.phase
        if self.real:
            if call is not None and self.real_forward is not None:
                self.real_forward.keep(name, args, out)
            if condition is not None and self.real_forward is not None:
                self.real_forward.conditions.append(bool(out))
            self._keep_read(out)
        elif self.known.small(out):
            real = self.known.run(func, name, args, kwargs, random=self.batch_values and phase == "data")
            if real is not None:
                self.known.keep(out, real)
            self.bounds.follow(name, args, kwargs, out)
        else:
            self.known.forget_written(func, args)
            self.bounds.follow(name, args, kwargs, out)
        if phase not in ("forward", "loss"):
            return
        if not self.real:
            if self.reads_model(args):
                for t in output_tensors(out):
                    self._from_model[t.untyped_storage()] = True
            if (name in RANDOM_OPS and all(t.numel() <= 1 for t in output_tensors(out))) or reads(self._drawn, args):
                for t in output_tensors(out):
                    self._drawn[t.untyped_storage()] = True
        if name in RANDOM_OPS:
            found = draw_range(name, args, kwargs, out)
            if found is not None:
                self._draw_top[out.untyped_storage()] = found

    def from_model(self, t: torch.Tensor) -> None:
        """``t`` holds the model's values (a parameter or buffer)."""
        self._from_model[t.untyped_storage()] = True

    def reads_model(self, args: Any) -> bool:
        """Some tensor of ``args`` holds values the model's parameters or buffers went into."""
        return reads(self._from_model, args)

    def param_bytes(self) -> int:
        """The bytes of the model's parameters traced so far."""
        return sum(a.nbytes for a in self._recording.trace.allocs if a.category == "params")
