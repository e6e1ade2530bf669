"""The model and the optimizer under the trace: built on fake tensors, registered with the recorder, and told
each phase of the step.

``build_model`` calls the user's model factory under the fake modes (or, where the constructor sizes tensors by
values, for real with fake twins of its tensors); ``register_model`` names the modules and marks the parameters,
gradients and buffers; ``on_phase`` marks the optimizer's state as it appears.
"""

from __future__ import annotations

import gc
import itertools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from memfit import _torch_private as tp
from memfit.errors import WorkloadError
from memfit.estimate.cudnn_rnn import flatten_weights
from memfit.estimate.optimizer_twins import stand_in
from memfit.estimate.step_copies import grad_keys
from memfit.estimate.value_reads import ValuesNeededToBuild
from memfit.estimate.values import KnownElementWrites

if TYPE_CHECKING:
    from memfit.estimate.recorder import Recorder

__all__ = ["ForwardRecorded", "build_model", "cuda_default_optimizer", "meta_forward", "on_phase",
           "register_model", "stand_in_optimizer"]

log = logging.getLogger(__name__)


class ForwardRecorded(Exception):
    """The real forward and loss of the first step ran (``RealForward``): the rest of the step is not needed."""


def stand_in_optimizer(optimizer: torch.optim.Optimizer, state: str, *, recorder: Recorder) -> torch.optim.Optimizer:
    return stand_in(optimizer, state, recorder)


def cuda_default_optimizer(optimizer: torch.optim.Optimizer) -> None:
    # torch.optim picks foreach on CUDA when the user sets neither foreach nor fused, but fake tensors fail its
    # type check and would silently get the for-loop path, which has different temporaries.
    for group in optimizer.param_groups:
        if "foreach" in group and group.get("foreach") is None and not group.get("fused"):
            group["foreach"] = True


def build_model(factory: Any, recorder: Recorder, dry_run: Callable[[torch.nn.Module], None]) -> Any:
    """Call the model factory under the fake modes; if the constructor sizes tensors by tensor values (timm's
    RegNet takes its stage widths from ``torch.unique``), build the model for real on the CPU instead and give
    the trace fake parameters and buffers of the same shapes, dtypes and strides, in the same order. Host memory:
    the model's parameters, once. A model with lazy modules is built on the meta device and sized by ``dry_run``
    (``_built_lazily``)."""
    recorder.building_model = True
    op: str | None = None
    try:
        with KnownElementWrites(recorder.step_values.known):
            return factory()
    except ValuesNeededToBuild as exc:
        op = str(exc)
    except RuntimeError as exc:
        # torch.nn's lazy modules: their placeholder parameters are a Tensor subclass, which a fake tensor cannot
        # become (torch.nn.parameter.UninitializedParameter: Tensor._make_subclass of a FakeTensor raises)
        if not any(n in str(exc) for n in ("UninitializedParameter", "UninitializedBuffer")):
            raise
    finally:
        recorder.building_model = False
    gc.collect()  # the half-built model's fake tensors go now, with their frees, before the rebuild allocates
    if op is None:
        return _built_lazily(factory, dry_run)
    with tp.no_dispatch_modes():
        real = factory()
    nbytes = _fake_twins(real)
    msg = (f"the model's constructor sizes a tensor by tensor values ({op}), which fake tensors do not have: "
           f"memfit built it for real on the CPU ({nbytes / 2**20:.0f} MiB of host memory) and traced fake copies "
           "of its parameters and buffers.")
    recorder.trace.warnings.append(msg)
    log.warning(msg)
    return real


def _fake_twins(model: torch.nn.Module) -> int:
    """Replace every parameter and buffer of ``model`` by a fake tensor of the same shape, dtype and strides (made
    under the trace's modes, so the recorder sees each), shared ones once; the bytes of the tensors replaced."""
    twins: dict[int, torch.Tensor] = {}
    replaced: dict[int, torch.Tensor] = {}

    def twin(t: torch.Tensor, parameter: bool) -> torch.Tensor:
        if id(t) not in twins:
            fake = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype)
            twins[id(t)] = torch.nn.Parameter(fake, t.requires_grad) if parameter else fake
            replaced[id(t)] = t
        return twins[id(t)]

    # setattr on a registered name replaces the tensor and keeps its registration (a buffer stays persistent or
    # not); each list is read whole before the first replacement
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            setattr(module, name, twin(p, parameter=True))
        for name, b in list(module.named_buffers(recurse=False, remove_duplicate=False)):
            setattr(module, name, twin(b, parameter=False))
    return sum(t.untyped_storage().nbytes() for t in replaced.values())


def _built_lazily(factory: Any, dry_run: Callable[[torch.nn.Module], None]) -> torch.nn.Module:
    """A model with torch.nn's lazy modules (``nn.LazyLinear`` ...), whose parameters take their shapes from their
    first input. Their placeholders are a Tensor subclass, which a fake tensor cannot become, so the model is built
    on the meta device (shapes, no memory), ``dry_run`` runs its forward there once without autograd, which gives
    the lazy parameters their shapes, and the trace gets fake twins of every parameter and buffer, as for a model
    built for real. A materialized lazy module is its plain twin (``cls_to_become``): the same tensors."""
    from torch.nn.modules.lazy import LazyModuleMixin

    from memfit.workload.user_errors import one_line, user_place

    with tp.no_dispatch_modes(), torch.device("meta"):
        model = factory()
        try:
            with torch.no_grad():
                dry_run(model)
        except Exception as exc:  # noqa: BLE001 - said in one line: the model's forward on shapes alone
            place = user_place(exc)
            text = one_line(exc).rstrip(".")
            raise WorkloadError(
                "the model has lazy modules (nn.LazyLinear, nn.LazyConv2d, ...), which take their sizes from a first "
                f"forward; memfit ran it on shapes alone (meta tensors) and it failed{f' at {place}' if place else ''}: "
                f"{text}. Give each lazy module its input size (nn.Linear(in_features, out_features)).") from exc
    unsized = [name or type(m).__name__ for name, m in model.named_modules() if isinstance(m, LazyModuleMixin)
               and m.has_uninitialized_params()]  # type: ignore[misc]  # torch types its self as a Protocol
    if unsized:
        raise WorkloadError(f"the lazy module {unsized[0]} got no input in the model's forward, so it has no size: "
                            "give it its input size (nn.Linear(in_features, out_features)).")
    _fake_twins(model)
    log.info("the model has lazy modules: memfit sized them by one forward on shapes alone (meta tensors)")
    return model


def meta_forward(workload: Any, model: torch.nn.Module) -> None:
    """The workload's forward on a batch of one, where the caller put it (``_built_lazily``: the meta device)."""
    workload.run_forward(model, workload.batch(1))


def register_model(recorder: Recorder, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    recorder.module_names = {id(m): (name or type(m).__name__) for name, m in model.named_modules()}
    compiled = [name or type(model).__name__ for name, m in model.named_modules() if tp.is_compiled_module(m)]
    if compiled:
        msg = (f"{compiled[0]} is torch.compile'd: memfit estimates it as eager PyTorch (compiled code fuses ops and "
               "usually needs less memory, so the estimate is on the high side).")
        recorder.trace.warnings.append(msg)
        log.warning(msg)
        recorder.trace.uncertain["compiled"] = msg
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.RNNBase):
            flatten_weights(m, again=False)  # a model built before the trace: moved to CUDA, it would be flat
            recorder.trace.uncertain.setdefault(
                "rnn_kernel", f"{name or type(m).__name__} ({type(m).__name__}): cuDNN's fused RNN, sized by rules "
                "calibrated on a grid of shapes")
    for p in model.parameters():
        recorder.mark(p, "params")
        recorder.trace.param_count += p.numel()
        if p.requires_grad:  # a frozen parameter gets no grad (and torch refuses a hook on it)
            p.register_post_accumulate_grad_hook(lambda p: recorder.mark(p.grad, "grads"))
    for b in model.buffers():
        recorder.mark(b, "buffers")
    for t in itertools.chain(model.parameters(), model.buffers()):
        if t.layout == torch.strided:
            recorder.step_values.from_model(t)


def on_phase(recorder: Recorder, optimizer: torch.optim.Optimizer, name: str, step: int) -> None:
    if name == "backward" and recorder.real and recorder.step_values.real_forward is not None:
        raise ForwardRecorded  # the forward and loss gave the sizes: backward would only cost time
    if name == "optimizer" and step == 0:
        recorder.grad_keys = grad_keys(recorder, optimizer)
    if recorder.phase == "optimizer":
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    recorder.mark(value, "optimizer_state")
    recorder.set_phase(name, step)
