"""The training-step protocol that memfit predicts and measures — one function, used by both.

Model and optimizer are created on the device from an empty allocator, the batch is placed on the device, then
``steps`` training steps run, each: ``zero_grad(set_to_none=True)``, forward and loss under autocast for the
precision, backward (scaled for fp16), ``optimizer.step()`` (through the GradScaler for fp16). Estimating and
measuring run this same code, so they cannot drift apart.

Two loops differ in when the model's output goes (``Workload.keep_output``):

* the plain loop users write, ``out = model(x); loss = crit(out, y); loss.backward(); opt.step()``: ``out`` and
  ``loss`` stay alive through backward and the optimizer step, and are freed only when the next forward rebinds
  ``out`` — so the last output is alive during the next forward too (``keep_output=True``, the default);
* the loss-only step of Lightning's ``training_step`` and Hugging Face Trainer's ``compute_loss``, which return
  the loss and drop the output before backward (``keep_output=False``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from memfit.errors import WorkloadError
from memfit.workload.chunked_cross_entropy import use_chunked_cross_entropy
from memfit.workload.knobs import apply_checkpointing, set_optimizer_impl
from memfit.workload.optimizer_state import set_optimizer_state
from memfit.workload.spec import Workload

DEFAULT_STEPS = 3
MAX_SKIPPED_STEPS = 24
"""How many more steps ``run_steps(settle_scaler=True)`` may run while a fresh GradScaler's overflows skip the
optimizer: the scale starts at 2**16 and halves on each skip, so 24 skips reach 2**-8."""
PHASES = ("init", "data", "zero_grad", "forward", "loss", "backward", "optimizer", "end")

PhaseCallback = Callable[[str, int], None]


def _no_phase(name: str, step: int) -> None:
    return None


def autocast_dtype(precision: str) -> torch.dtype | None:
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def to_channels_last(model: torch.nn.Module) -> None:
    """Convert 4-D/5-D parameters in place of ``Module.to(memory_format=...)``, which fake tensors refuse."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            if p.dim() not in (4, 5):
                continue
            fmt = torch.channels_last if p.dim() == 4 else torch.channels_last_3d
            # setattr of a Parameter on a parameter's name re-registers it: Module.register_parameter
            setattr(module, name, torch.nn.Parameter(p.detach().contiguous(memory_format=fmt),
                                                     requires_grad=p.requires_grad))


def place_batch(batch: Any, device: torch.device | str, channels_last: bool) -> Any:
    """Move every tensor of ``batch`` to ``device`` (no copy when it is already there)."""

    def move(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        t = t.to(device)
        if channels_last and t.is_floating_point() and t.dim() in (4, 5):
            t = t.contiguous(memory_format=torch.channels_last if t.dim() == 4 else torch.channels_last_3d)
        return t

    if isinstance(batch, dict):
        return {k: place_batch(v, device, channels_last) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(place_batch(v, device, channels_last) for v in batch)
    return move(batch)


def build(
    workload: Workload, device: torch.device | str, *, configure_optimizer: Callable[[Any], None] | None = None,
    phase: PhaseCallback = _no_phase,
    keep_states: Callable[[torch.optim.Optimizer, str], torch.optim.Optimizer] = set_optimizer_state,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """Create the model, the optimizer and the batch on ``device``. ``keep_states(optimizer,
    workload.optimizer_state)`` gives the optimizer that keeps its states as asked: torchao's by default, the
    estimator's stand-ins in a trace (``memfit.estimate.optimizer_twins``)."""
    phase("init", 0)
    with torch.device(device):
        model = workload.model()
        if not isinstance(model, torch.nn.Module):
            raise WorkloadError(f"Workload.model() returned a {type(model).__name__}, not a torch.nn.Module: the "
                                "factory must build and return the model, e.g. model=lambda: MyNet(...).")
        if torch.device(device).type != "cpu":
            # a tensor made by the legacy constructor ignores the device context (Deformable DETR's
            # `nn.Parameter(torch.Tensor(levels, d_model))` stayed on the CPU, and its first forward failed on an
            # H200): the user's `.to(device)` moves it, so does this
            model.to(device)
        if workload.channels_last:
            to_channels_last(model)
        if workload.checkpoint:
            apply_checkpointing(model, workload.checkpoint, workload.checkpoint_mode)
        if workload.loss_impl == "chunked":
            use_chunked_cross_entropy(model)
        model.train()
        optimizer = set_optimizer_impl(workload.optimizer(model.parameters()), workload.optimizer_impl)
        optimizer = keep_states(optimizer, workload.optimizer_state)
    if configure_optimizer is not None:
        configure_optimizer(optimizer)
    phase("data", 0)
    with torch.device(device):
        batch = place_batch(workload.make_batch(workload.batch_size), device, workload.channels_last)
    return model, optimizer, batch


def run_steps(
    workload: Workload,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    *,
    autocast_device: str,
    scaler: Any | None,
    steps: int = DEFAULT_STEPS,
    phase: PhaseCallback = _no_phase,
    micro_batches: int | None = None,
    replay: Callable[[int, list[Any]], bool] | None = None,
    replay_micro: Callable[[int, list[Any]], bool] | None = None,
    settle_scaler: bool = False,
) -> int:
    """Run ``steps`` training steps; ``phase(name, step)`` is called as each phase begins. Returns the steps run.

    Each step runs ``accumulation_steps`` micro-batches (``micro_batches`` overrides it: the tracer runs at most
    three, ``memfit.estimate.trace.TRACED_MICRO_BATCHES``) on the same placed batch, as a loader that yields
    micro-batches would. ``replay(step, held)``, called after ``zero_grad``, may account for the step's forward
    and backward itself (the tracer copies an earlier step's) and return True: the step then goes on to the
    optimizer. ``held`` is the list that keeps the plain loop's last output and loss alive; a replay puts in it
    what stands for the copied step's. ``replay_micro(step, held)``, called before each micro-batch from the third
    on, may likewise account for that micro-batch itself (the tracer copies the second's) and return True.

    ``settle_scaler`` (measuring on a GPU): with fp16's GradScaler, go on past ``steps`` (at most
    ``MAX_SKIPPED_STEPS`` more) until the optimizer really stepped and a whole step ran after it. A fresh scaler's
    first steps overflow and skip ``optimizer.step()``, so the optimizer's state does not exist yet: a torchvision
    ResNet-50 in fp16 with Adam skipped all 3 protocol steps on an H100 (corpus entry c006,
    ``entry_traces_fit_h100_torch2.11_20261126``: not one allocation from ``adam.py``) and peaked 18 % below the
    estimate, which counts the state, as every step after the first few has it.
    """
    dtype = autocast_dtype(workload.precision)
    micro = workload.accumulation_steps if micro_batches is None else micro_batches
    held: list[Any] = []  # the plain loop's `out` and `loss` of the last micro-batch (keep_output)
    total = steps
    first_real_step: int | None = None  # the first step whose optimizer.step() ran
    step = 0
    while step < total:
        phase("zero_grad", step)
        # set_to_none frees last step's grads before forward, keeping them out of the activation peak
        optimizer.zero_grad(set_to_none=True)
        for index in range(0 if replay is not None and replay(step, held) else micro):
            if index >= 2 and replay_micro is not None and replay_micro(step, held):
                continue
            phase("forward", step)
            ctx = torch.autocast(autocast_device, dtype=dtype) if dtype is not None else contextlib.nullcontext()
            with ctx:
                output = workload.run_forward(model, batch)
                # `out = model(x)` rebinds `out` only now: the previous output was alive during this forward
                while held:
                    held.pop()  # last first, the order the tracer's copied steps free them in
                phase("loss", step)
                loss = workload.loss(output, batch)
                if workload.accumulation_steps > 1:
                    loss = loss / workload.accumulation_steps  # the mean over the effective batch
            if workload.keep_output:
                held[:] = [output, loss]
            # the loss-only step: what backward needs is held by the graph, the rest of the output goes now
            del output
            phase("backward", step)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            del loss
        phase("optimizer", step)
        if scaler is not None:
            scale = scaler.get_scale() if settle_scaler else 0.0
            scaler.step(optimizer)
            scaler.update()
            if settle_scaler:
                if first_real_step is None and scaler.get_scale() >= scale:  # update() halves the scale on a skip
                    first_real_step = step
                # about to stop with no real step yet, or with it last: the state has not been through a step
                unsettled = first_real_step is None or first_real_step == step
                if step == total - 1 and unsettled and total < steps + MAX_SKIPPED_STEPS:
                    total += 1
        else:
            optimizer.step()
        step += 1
    phase("end", total)
    held.clear()  # after the last step: nothing the trace counts
    return total


def run_steps_on_cuda(
    workload: Workload, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any, *, steps: int,
    phase: PhaseCallback = _no_phase,
) -> int:
    """``run_steps`` on a CUDA device as memfit measures and times it: fp16 through a fresh ``GradScaler``, run past
    its skipped steps until the optimizer really stepped (``settle_scaler``). Returns the steps run."""
    scaler = torch.amp.GradScaler("cuda") if workload.precision == "fp16" else None
    return run_steps(workload, model, optimizer, batch, autocast_device="cuda", scaler=scaler, steps=steps,
                     phase=phase, settle_scaler=True)
