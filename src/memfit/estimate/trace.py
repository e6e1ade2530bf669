"""Trace a training step on fake tensors: the ordered stream of storage allocations and frees.

``trace_workload`` runs the protocol (``memfit.workload.protocol``) on fake CPU tensors under the recorder
(``memfit.estimate.recorder``), a ``TorchDispatchMode`` above ``FakeTensorMode`` that sees every ATen op below
autograd and autocast — the casts, the saved activations, every backward op, the optimizer's foreach
temporaries — and turns each storage into an allocation and a free. No tensor data is ever allocated, so a 3-D
U-Net at 128^3 traces in a few hundred MB of host memory. Where sizes or conditions depend on values fake
tensors lack, it traces again with the values of one batch or of one real CPU forward.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import logging
import threading
from typing import Any, NoReturn

import torch

from memfit import _torch_private as tp
from memfit.errors import MemfitError
from memfit.estimate import step_copies
from memfit.estimate.cuda_emulation import CudaSemantics
from memfit.estimate.data_dependent import (
    RealForward,
)
from memfit.estimate.device_calls import user_device_calls
from memfit.estimate.gpus import GpuSpec
from memfit.estimate.library_paths import RealRunPaths
from memfit.estimate.recorder import Recorder
from memfit.estimate.trace_record import Trace
from memfit.estimate.trace_setup import (
    ForwardRecorded,
    build_model,
    cuda_default_optimizer,
    meta_forward,
    on_phase,
    register_model,
    stand_in_optimizer,
)
from memfit.estimate.value_reads import CONDITION, ValuesNeededToTrace, user_frame
from memfit.units import format_bytes
from memfit.workload.protocol import DEFAULT_STEPS, build, run_steps
from memfit.workload.selective_checkpoint import REGIONS as selective_regions
from memfit.workload.spec import Workload
from memfit.workload.user_errors import user_code_error

log = logging.getLogger(__name__)


CONDITION_REAL_FORWARD_MAX_PARAM_BYTES = 4 << 30
"""A condition on the model's values is decided by one real CPU forward only up to this much of parameters (a
1-billion-parameter fp32 model), which that forward builds for real in host memory: a check such as `if not
torch.isfinite(loss):` in a large language model's step does not cost its weights' size in RAM. Beyond it the
condition is taken as False, as before such conditions were followed, and the bound still names it."""


HOST_COPY = "a copy to host memory (.numpy())"
"""What ``ValuesNeededToTrace`` names for ``.numpy()`` of a tensor whose values the trace does not have."""


_TORCH_NUMPY = torch.Tensor.numpy  # torch's own, taken at import (HostCopies replaces it for a while)
_TORCH_TOLIST = torch.Tensor.tolist
_TORCH_FORMAT = torch.Tensor.__format__


class HostCopies:
    """``.numpy()`` (and NumPy's ``np.asarray`` of a tensor, which calls it) in forward and loss, which fake tensors
    refuse.

    A step that hands values to NumPy or SciPy (DETR's Hungarian matching) gets them as the op-level values do:
    computed, where they are known (from constants or the batch's values); else what the real forward's copy in
    the same place in call order gave, if it had the same shape; else the step is traced again with them
    (``ValuesNeededToTrace``). The real forward keeps what each copy gave (``RealForward.host_copies``).

    Inside, ``torch.Tensor.numpy`` is this object's ``numpy`` for the thread that entered (other threads get
    torch's), and ``tolist``, which reads values without an op, writes the real forward's pending stand-in outputs
    first (``ProductStandIns.fill``; ``.numpy()`` runs a ``detach``, which does); a one-element fake tensor formats
    by its value (``format``). It was a ``TorchFunctionMode``, which runs Python for every torch call of the step, ``.shape``
    included: 15 % of timm MaxViT-T's estimate on a 2-core CPU (14.1 s against 11.9;
    ``benchmarks/results/estimate/estimate_time_hostcopies_cpu_torch2.14_20261128.md``).
    """

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self._thread = threading.get_ident()
        self._own: dict[tuple[type, str], Any] = {}  # what each class's own dict held under a name (None: inherited)

    def __enter__(self) -> HostCopies:
        host_copies = self

        def numpy(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            return host_copies.numpy(t, *args, **kwargs)

        def tolist(t: torch.Tensor) -> Any:
            return host_copies.tolist(t)

        def format_fake(t: torch.Tensor, spec: str) -> str:
            return host_copies.format(t, spec)

        for owner, name, method in ((torch.Tensor, "numpy", numpy), (torch.Tensor, "tolist", tolist),
                                    (tp.FakeTensor, "__format__", format_fake)):
            self._own[owner, name] = owner.__dict__.get(name)
            setattr(owner, name, method)
        return self

    def __exit__(self, *exc: object) -> None:
        for (owner, name), own in self._own.items():
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)

    def format(self, t: torch.Tensor, spec: str) -> str:
        """``format()`` of a fake tensor (an f-string): a one-element one as a CUDA tensor formats, by its value (a
        read, answered as ``.item()`` is); torch formats a tensor subclass, as fake tensors are, by its repr.
        Switch Transformers names its expert's module ``f"expert_{index}"``."""
        if threading.get_ident() == self._thread and t.dim() == 0:
            return format(t.item(), spec)
        return _TORCH_FORMAT(t, spec)

    def tolist(self, t: torch.Tensor) -> Any:
        stand_ins = self.recorder.step_values.stand_ins
        if stand_ins is not None and threading.get_ident() == self._thread:
            stand_ins.fill(t)
        return _TORCH_TOLIST(t)

    def numpy(self, t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        r = self.recorder
        if threading.get_ident() != self._thread or r.phase not in ("forward", "loss"):
            return _TORCH_NUMPY(t, *args, **kwargs)
        values = r.step_values
        index, values.host_copies = values.host_copies, values.host_copies + 1
        if r.real:
            out = _TORCH_NUMPY(t, *args, **kwargs)
            if values.real_forward is not None:
                values.real_forward.host_copies.append(out.copy())
            return out
        known = values.known.value(t)
        if known is not None:
            with tp.no_dispatch_modes():  # the real tensor's own values, not the fake mode's
                return _TORCH_NUMPY(known, *args, **kwargs)
        recorded = values.real_forward.host_copies if values.real_forward is not None else []
        if index < len(recorded) and tuple(recorded[index].shape) == tuple(t.shape):
            r.trace.uncertain.setdefault("data_dependent_shape", f".numpy() at {user_frame()}: values from one "
                                         "real CPU forward")
            return recorded[index]
        raise values.needed(HOST_COPY, [t])


def trace_workload(workload: Workload, gpu: GpuSpec, *, steps: int = DEFAULT_STEPS) -> Trace:
    """Run the protocol of ``workload`` on fake CPU tensors with CUDA semantics and return its event stream.

    Steps from the third on repeat the second (optimizer state exists from step 1 on, so step 2 is the steady
    state): they are copied rather than traced, which saves a third of the time. If step 2 does not hand over
    to its successor exactly as step 1 handed over to it, every step is traced instead.

    When an op's output size depends on values (``nonzero``, boolean masks) that neither constants nor a proof
    give (memfit.estimate.data_dependent), the steps are traced again with the values of one random batch known:
    a mask made from the labels is then known. If the values come from the model (a detector's proposals), the
    first step's forward and loss run once for real on the CPU (without autograd, its large products and batch
    norms stood in for by noise of their scale: ``ProductStandIns``), and the steps are traced again with the
    sizes it gave. Only if that is not enough either (a value-dependent size in backward) do all the steps run for real.
    A condition on values (``if x.abs().sum() > 0:``) goes the same way, the real forward handing over what it read;
    one on a random draw of the step (LayerDrop) is taken as False, the draw that skips nothing.
    Each way is said in a warning and in ``uncertain``.
    """
    try:
        return _trace_steps(workload, gpu, steps)
    except ValuesNeededToTrace as exc:
        op, where, from_model, param_bytes = exc.args
    if not from_model:  # the batch's values may decide it (a mask made from the labels)
        try:
            trace = _trace_steps(workload, gpu, steps, batch_values=True)
            return _sized_from(trace, "the values of one random batch (the workload's batch, made for real on the "
                               "CPU)", op, where)
        except ValuesNeededToTrace as exc:
            op, where, _, param_bytes = exc.args
    if op == CONDITION and param_bytes > CONDITION_REAL_FORWARD_MAX_PARAM_BYTES:
        # conditions alone do not justify building a large model for real: taken as False, named in the bound (an
        # empty RealForward answers every read from "no real value", see StepValues.unknown_read)
        log.info("%s: conditions on the model's values taken as False (its %s of parameters are not built for "
                 "real on the CPU to decide them)", workload.name, format_bytes(param_bytes))
        try:
            return _trace_steps(workload, gpu, steps, batch_values=True, real_forward=RealForward())
        except ValuesNeededToTrace as exc:  # a size the model's values decide: the real forward after all
            op, where, _, param_bytes = exc.args
    log.info("running the forward of %s for real on the CPU: %s at %s sizes its output by values", workload.name,
             op, where)
    forward = _real_forward(workload, gpu)
    try:
        trace = _trace_steps(workload, gpu, steps, batch_values=True, real_forward=forward)
        return _sized_from(trace, ("one real CPU forward of the first step (same shapes, random data; its large "
                                  "products stood in for by noise of their scale)"), op, where)
    except ValuesNeededToTrace as exc:
        op, where, _, _ = exc.args
    trace = _trace_steps(workload, gpu, steps, real=True)
    return _sized_from(trace, "every step run for real on the CPU (same shapes, random data)", op, where)


def _sized_from(trace: Trace, source: str, op: str, where: str) -> Trace:
    """Say in ``trace`` that value-dependent sizes or conditions (first: ``op`` at ``where``) came from ``source``.

    A condition keeps the ``value_branch`` widening (real data may take the other branch), unless every condition
    the trace answered so only checks the values (``value_check``: the other branch raises, warns or runs only on
    overflowed values)."""
    if op == CONDITION:
        unsure = [site for site, check in trace.condition_sites.items() if not check]
        if trace.condition_sites and not unsure:
            sites = ", ".join(trace.condition_sites)
            msg = (f"the step checks tensor values at {sites}, which fake tensors do not have: memfit took each "
                   f"check the way {source} took it (the other way each raises, warns or runs only on overflowed "
                   "values).")
            trace.uncertain["value_check"] = (f"{op} at {sites}: only checks (the other branch raises, warns or runs "
                                              f"only on overflowed values), each taken the way {source} took it")
            log.info(msg)  # named in the bound's reasons; no warning: nothing the user can change or should doubt
            return trace
        where = unsure[0] if unsure else where
        msg = (f"the step branches on tensor values at {where}, which fake tensors do not have: memfit took each "
               f"branch the way {source} took it. Other data may take another branch.")
        trace.uncertain["value_branch"] = f"{op} at {where}: each branch the way {source} took it"
    else:
        msg = (f"the step calls {op} at {where}, whose output size depends on values that fake tensors do not "
               f"have: memfit took the sizes from {source}.")
        trace.uncertain["data_dependent_shape"] = f"{op} at {where}: sizes from {source}"
    log.warning(msg)
    trace.warnings.insert(0, msg)
    return trace


def _real_forward(workload: Workload, gpu: GpuSpec) -> RealForward:
    """What the value-dependent ops of the first step's forward and loss return when run for real on the CPU.

    It runs without autograd: only values are kept, and the activations autograd would save (most of a Faster
    R-CNN's 6.2 GB peak at 4 × 800²) are each a first write to fresh host memory. A loss that needs autograd in
    forward (``torch.autograd.grad`` of a gradient penalty) fails so; it runs again with it."""
    forward = RealForward()
    try:
        with torch.no_grad():
            _trace(workload, gpu, steps=1, real=True, real_forward=forward)
    except ForwardRecorded:
        return forward
    except Exception:  # noqa: BLE001 - any failure without autograd: the same forward with it decides
        log.info("the real forward of %s failed without autograd; running it with autograd", workload.name)
    forward = RealForward()
    try:
        _trace(workload, gpu, steps=1, real=True, real_forward=forward)
    except ForwardRecorded:
        pass
    return forward


def _trace_steps(workload: Workload, gpu: GpuSpec, steps: int, *, real: bool = False, batch_values: bool = False,
                 real_forward: RealForward | None = None) -> Trace:
    run = functools.partial(_trace, workload, gpu, real=real, batch_values=batch_values, real_forward=real_forward)
    if steps > 2 and not real:
        trace = run(steps=2)
        if step_copies.repeat_last_step(trace, steps - 2):
            return trace
    return run(steps=steps)


INTERPRETER_FROZEN = gc.get_freeze_count()
"""Objects already frozen when memfit is imported: CPython 3.12 starts with 375 (3.11 and 3.13 with none; checked
with ``python -S``, so no site module froze them). Taking 0 as "the caller froze nothing" kept every trace on
3.12 from freezing, and its full collections walked the whole process. ``OldObjectsFrozen`` unfreezes these with
its own: freezing only keeps the collector from walking objects, and none of them is garbage. A set frozen before
memfit's import on purpose (a pre-fork server that froze first) would be unfrozen too."""


class OldObjectsFrozen:
    """Keeps Python's cyclic garbage collector off the objects that exist before the training steps.

    A trace makes many short-lived objects, so the collector runs often, and each full collection walks every
    object in the process: torch, torch._dynamo and the model's libraries (450k objects with MONAI and
    transformers). On the MONAI Swin-UNETR estimate those walks took 0.7-1.1 s of 12 on a 2-core machine
    (benchmarks/results/estimate_time_cpu_20261126.md, in git history at commit 5724dc6). ``gc.freeze()`` leaves
    the old objects out. It does not
    move a free in the trace: fake storages go by reference count (none of the benchmark suite's 13 workloads
    frees one from the collector), and ``freeze(collect=True)`` after building frees garbage from building first
    instead of keeping it frozen to the end.

    ``estimate`` holds it over the analysis and replays after the trace too: the first full collection there walked
    every object again, the trace's garbage with them (0.53 s of a DETR estimate, 26,559 objects freed, 2-core CPU,
    session 23). That garbage is frozen with the rest and freed at a later full collection instead.
    """

    def __enter__(self) -> OldObjectsFrozen:
        # a caller that freezes objects itself (a pre-fork server) keeps its frozen set: ours would unfreeze it. What
        # the interpreter froze before memfit was imported is not such a set (see INTERPRETER_FROZEN)
        self._active = gc.get_freeze_count() <= INTERPRETER_FROZEN
        if self._active:
            gc.freeze()
        return self

    def freeze(self, *, collect: bool = False) -> None:
        """Freeze what exists now too; ``collect`` first frees what is already garbage."""
        if self._active:
            if collect:
                gc.collect()
            gc.freeze()

    def __exit__(self, *exc: object) -> None:
        if self._active:
            gc.unfreeze()


def _trace(workload: Workload, gpu: GpuSpec, *, steps: int, real: bool = False, batch_values: bool = False,
           real_forward: RealForward | None = None) -> Trace:
    quiet = _QuietFakeTensorLog()
    _FAKE_TENSOR_LOG.addFilter(quiet)
    recorder = Recorder(gpu, real=real, batch_values=batch_values, real_forward=real_forward)
    # a batch made for real is seeded (BATCH_SEED): the caller's random state is given back afterwards
    seeded = torch.random.fork_rng(devices=[]) if real or batch_values else contextlib.nullcontext()
    try:
        with OldObjectsFrozen() as old_objects, seeded:
            if real:
                torch.manual_seed(MODEL_SEED)
            return _trace_frozen(workload, recorder, steps=steps, old_objects=old_objects)
    finally:
        _FAKE_TENSOR_LOG.removeFilter(quiet)


MODEL_SEED = 1
"""torch's CPU generator is seeded with this before a model is built for real (the forward that sizes a detector's
outputs), so that its weights, and the sizes they decide, are the same in every run. Left to the generator's state
at that moment, which the traces before it left differently from one process to the next, torchvision's Keypoint
R-CNN kept 8,381 or 8,382 boxes after ``remove_small_boxes`` and its estimated ``fits_in`` moved by 2.5 % between
two runs of the same code (benchmarks/results/estimate/real_forward_seed_cpu_torch2.14_20261128.md)."""


TRACED_MICRO_BATCHES = 3
"""Micro-batches per step in the allocation stream. From the second on each allocates what the one before did, with
the grads alive, but the caching allocator's blocks keep moving: a 2-D U-Net at 4 micro-batches (corpus fit entry
c032, H100 stream) needs a 623 MB cap with two in the stream, 682 MB with three and the same with all four
(measured: 698 MB). Later ones are taken to repeat the third. Two are traced, the third copied from the second
(``step_copies.copy_micro_batch``): each micro-batch in the stream costs the planner's replays time (GPT-2's plan at 5.5 GiB,
34 s with four on the 2-core CPU)."""


def _trace_frozen(workload: Workload, recorder: Recorder, *, steps: int, old_objects: OldObjectsFrozen) -> Trace:
    """One traced run of the protocol; with ``recorder.real``, on real CPU tensors (every op computes) instead of
    fake ones."""
    real = recorder.real
    # progress for the CLI's spinner (memfit.cli._progress): a large model can take minutes to build
    log.info("building %s (batch %d × %d, %s)", workload.name, workload.batch_size, workload.accumulation_steps,
             workload.precision)
    fake_mode: Any = (contextlib.nullcontext() if real else
                      tp.StaticShapeFakeTensorMode(allow_non_fake_inputs=True, allow_fallback_kernels=False))
    old_objects.freeze()  # torch._dynamo, which FakeTensorMode imports on first use
    hooks = [
        torch.nn.modules.module.register_module_forward_pre_hook(recorder.pre_forward),
        torch.nn.modules.module.register_module_forward_hook(recorder.post_forward),
    ]
    # each selective recompute hands back the outputs its forward kept, unseen by the recorder: count them
    selective_regions.on_recompute = recorder.costs.kept_outputs
    # the real forward that sizes a detector's outputs keeps only values and sizes: its fp16 ops may compute in fp32
    semantics = CudaSemantics(recorder.gpu, half_in_fp32=real and recorder.step_values.real_forward is not None)
    try:
        with fake_mode, recorder, semantics:
            try:
                with user_device_calls():  # Net().cuda(), .to(device), device="cuda" in the factories
                    model, optimizer, batch = build(
                        workload.replace(model=functools.partial(build_model, workload.model, recorder,
                                                                 functools.partial(meta_forward, workload))), "cpu",
                        configure_optimizer=cuda_default_optimizer, phase=recorder.set_phase,
                        keep_states=functools.partial(stand_in_optimizer, recorder=recorder),
                    )
            except Exception as exc:
                _raise_blamed(exc, "building the model, the optimizer or the batch", recorder)
            old_objects.freeze(collect=True)  # the model, the optimizer, the libraries imported to build them
            log.info("tracing %d training steps of %s", steps, workload.name)
            register_model(recorder, model, optimizer)
            scaler = torch.amp.GradScaler("cpu") if workload.precision == "fp16" else None
            try:
                with RealRunPaths(model), HostCopies(recorder):  # the libraries take a real run's path; .numpy()
                    run_steps(
                        workload, model, optimizer, batch, autocast_device="cpu", scaler=scaler, steps=steps,
                        phase=functools.partial(on_phase, recorder, optimizer),  # bound now: `del` below
                        micro_batches=min(workload.accumulation_steps, TRACED_MICRO_BATCHES),
                        replay_micro=None if real else functools.partial(step_copies.copy_micro_batch, recorder),
                        # a real step's sizes can change from step to step (a detector's matches move with its
                        # weights): each is traced; a fake one repeats the first (see step_copies.replay_forward_backward)
                        replay=None if real else functools.partial(step_copies.replay_forward_backward, recorder, optimizer),
                    )
            except Exception as exc:
                _raise_blamed(exc, f"the training step ({recorder.phase}, step {recorder.step})", recorder)
            del model, optimizer, batch, scaler
    finally:
        selective_regions.on_recompute = None
        for h in hooks:
            h.remove()
    recorder.closed = True
    trace = recorder.trace
    # frees after the last step come from tearing the model down: no peak is there
    end = next(at for at, name, _ in reversed(trace.phase_marks) if name == "end")
    del trace.ops[end:], trace.keys[end:]
    return trace


def _raise_blamed(exc: Exception, during: str, recorder: Recorder) -> NoReturn:
    """Re-raise what the user's code raised as one line naming its file, line, module and op; memfit's own
    errors (a ``MemfitError``, or a bug raised by memfit's code) go on unchanged, and so does the request for a
    real step (``ValuesNeededToTrace``)."""
    if not isinstance(exc, (MemfitError, ValuesNeededToTrace, ForwardRecorded)):
        module = recorder.module_stack[-1] if recorder.module_stack else None
        error = user_code_error(exc, during=during, module=module, op=_failing_op(exc))
        if error is not None:
            raise error from exc
    raise exc


_RECORDER_FILE = inspect.getfile(Recorder)


def _failing_op(exc: BaseException) -> str | None:
    """The ATen op the recorder was dispatching when ``exc`` was raised (its ``name``), if any."""
    op = None
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code  # torch wraps __torch_dispatch__ (no dynamo): find the frame by its name
        if code.co_name == "__torch_dispatch__" and code.co_filename == _RECORDER_FILE:
            op = tb.tb_frame.f_locals.get("name", op)
        tb = tb.tb_next
    return op


class _QuietFakeTensorLog(logging.Filter):
    """Keeps FakeTensorMode's "failed while attempting to run meta" (a 27-line traceback) out of the log during a
    trace: the same error reaches the user once, as one line naming the place in their code."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR


_FAKE_TENSOR_LOG = logging.getLogger("torch._subclasses.fake_tensor")
