"""memfit in a Lightning ``Trainer``: plan the micro-batch under a memory budget, survive an OOM, explain the rest.

Example (not run here: it needs ``pip install 'memfit[integrations]'``)::

    import lightning as L
    from memfit.integrations.lightning import MemfitCallback

    trainer = L.Trainer(callbacks=[MemfitCallback(budget="24GiB")], max_epochs=3)
    trainer.fit(model, datamodule=dm)  # dm.batch_size (or model.batch_size) becomes the planned micro-batch

What the callback does, at ``on_fit_start`` (after Lightning set the model up, before it builds the dataloaders):

* with a ``budget``: builds a ``memfit.Workload`` from the LightningModule (a copy without its weights, its
  ``training_step`` as the loss, its optimizer) and one batch of its train dataloader, runs ``memfit.plan`` for the
  effective batch (batch-size attribute × ``accumulate_grad_batches``), and applies the plan: the micro-batch to
  the batch-size attribute (found as ``BatchSizeFinder`` finds it: ``lightning_hasattr``/``lightning_setattr``),
  ``trainer.accumulate_grad_batches``, activation checkpointing of the planned blocks, the optimizer's
  implementation, and the precision only with ``allow_precision_change=True``;
* with ``guard=True`` (the default): each ``training_step`` runs its forward *and* backward inside memfit's
  ``WindowGuard``. An OOM on any rank (agreed with ``strategy.reduce_boolean_decision``) rolls the accumulation
  window back, halves the pieces and runs the window again: the gradients at the optimizer step are those of a
  run without the OOM, no sample is skipped. Lightning's own backward and zero_grad then have nothing left to do
  (the module's ``backward`` and ``optimizer_zero_grad`` hooks are bypassed while the callback is attached);
* ``on_exception``: an OOM the guard could not get past (or any OOM with ``guard=False``) gets memfit's diagnosis
  as a note on the exception, printed with its traceback.

Supported: single-device and DDP strategies, automatic optimization, one optimizer. Not: FSDP, DeepSpeed,
manual optimization (use ``memfit.TrainStep`` inside your ``training_step``), SyncBatchNorm with the guard.
docs/integrations.md says what is and is not promised.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import operator
import warnings
from collections.abc import Mapping
from types import ModuleType
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from memfit.errors import MissingExtraError, UsageError
from memfit.estimate.gpus import GpuSpec, detect_gpu
from memfit.estimate.predict import Estimate, estimate
from memfit.guard import microbatch
from memfit.guard.agreement import reduce_gradients
from memfit.integrations.module_workload import batch_factory, meta_copy, model_factory
from memfit.integrations.oom_report import oom_report
from memfit.integrations.window import WindowGuard
from memfit.plan.records import Plan
from memfit.plan.search import DEFAULT_MARGIN, plan
from memfit.speed.model_choice import per_rank_choice
from memfit.units import format_bytes, parse_bytes
from memfit.workload.chunked_cross_entropy import use_chunked_cross_entropy
from memfit.workload.knobs import apply_checkpointing, optimizer_impls_for
from memfit.workload.spec import Precision, Workload

__all__ = ["MemfitCallback", "MemfitCallbackBase", "workload_from_lightning"]

logger = logging.getLogger(__name__)

# Lightning's precision flags -> (memfit's autocast precision, dtype the weights are cast to). "-true" flags keep
# the weights in that dtype and compute without autocast; "-mixed" flags autocast (16-mixed adds a GradScaler).
_PRECISION: dict[str, tuple[Precision, torch.dtype | None]] = {
    "32-true": ("fp32", None), "32": ("fp32", None),
    "16-mixed": ("fp16", None), "bf16-mixed": ("bf16", None),
    "bf16-true": ("fp32", torch.bfloat16), "16-true": ("fp32", torch.float16), "64-true": ("fp32", torch.float64),
}
# memfit's precision -> the Lightning flag that runs it, for a plan allowed to change precision
_LIGHTNING_FLAG: dict[str, str] = {"bf16": "bf16-mixed", "fp16": "16-mixed"}
_HOOKS = ("training_step", "backward", "optimizer_zero_grad")


# -------------------------------------------------------------------------------------------------- planning


def workload_from_lightning(
    trainer: Any, pl_module: Any, batch: Any, *, name: str | None = None
) -> Workload:
    """The training step of ``pl_module`` as ``trainer`` runs it, as a memfit ``Workload`` (no weights copied).

    The loss is ``training_step``'s (its ``"loss"`` for a dict); the optimizer is the class and settings of the
    trainer's optimizer (so ``configure_optimizers`` is not called again); the precision is the trainer's; the
    micro-batch and accumulation are the size of ``batch`` and ``trainer.accumulate_grad_batches``.

    Raises:
        UsageError: more than one optimizer, a precision memfit cannot model, or a batch it cannot rebuild.
    """
    flag = str(trainer.precision)
    if flag not in _PRECISION:
        raise UsageError(f"memfit cannot plan for Lightning precision {flag!r}: it models "
                         f"{', '.join(sorted(_PRECISION))}. Pass budget=None to use only the OOM guard.")
    precision, dtype = _PRECISION[flag]
    optimizers = list(trainer.optimizers)
    if len(optimizers) != 1:
        raise UsageError(f"memfit plans a step with one optimizer; this LightningModule has {len(optimizers)}. "
                         "Pass budget=None to use only the OOM guard.")
    real = optimizers[0]
    accepted = set(_init_parameters(type(real)))
    settings = {k: v for k, v in real.defaults.items() if k in accepted and k != "params"}
    make_batch, size = batch_factory(batch)
    # the trainer is shared state: the copy must not log into it (self.log without a trainer only warns)
    template = meta_copy(pl_module, detach=[trainer])

    def forward(module: Any, b: Any) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "self.log() without a trainer" on every traced step
            return module.training_step(b, 0)

    return Workload(
        model=model_factory(template, dtype=dtype),
        batch=make_batch,
        loss=_required_loss,
        optimizer=lambda params: type(real)(params, **settings),
        batch_size=size,
        accumulation_steps=int(trainer.accumulate_grad_batches),
        precision=precision,
        forward=forward,
        keep_output=False,  # training_step returns the loss; its output is gone before backward
        name=name or type(pl_module).__name__,
    )


def _init_parameters(cls: type) -> list[str]:
    return list(inspect.signature(cls).parameters)


def _required_loss(output: Any, batch: Any) -> torch.Tensor:
    loss = _loss_of(output)
    if loss is None:
        raise UsageError("training_step returned None for the batch memfit plans with; it needs the loss.")
    return loss


def _loss_of(output: Any) -> torch.Tensor | None:
    """The loss in what ``training_step`` returned: the tensor, a dict's ``"loss"``, or None (a skipped step)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    if output is None:
        return None
    raise UsageError(f"training_step returned {type(output).__name__}; memfit needs a loss tensor or a dict with "
                     "a 'loss' tensor (Lightning's automatic optimization).")


def _first_batch(trainer: Any, pl_module: Any) -> Any:
    """One batch of the train dataloader the datamodule (else the module) defines, as it comes from the loader."""
    source = trainer.datamodule if getattr(trainer, "datamodule", None) is not None else pl_module
    try:
        loader = source.train_dataloader()
        return next(iter(loader))
    except StopIteration:
        raise UsageError("the train dataloader is empty: memfit plans from one of its batches.") from None
    except Exception as exc:  # the default hook raises: the loader came from trainer.fit(train_dataloaders=...)
        raise UsageError(
            f"memfit plans from one batch of {type(source).__name__}.train_dataloader(), which failed "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). Define train_dataloader() "
            "on the LightningModule or a LightningDataModule, reading its batch size from the batch-size "
            "attribute, or pass budget=None."
        ) from exc


def _set_optimizer_impl_in_place(optimizer: torch.optim.Optimizer, impl: str) -> bool:
    """Switch ``optimizer``'s implementation in its param groups (Lightning's schedulers keep this object)."""
    offered = optimizer_impls_for(optimizer)
    if impl not in offered:
        return False
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if impl == "fused" and not all(p.is_cuda and p.is_floating_point() for p in params):
        return False  # fused kernels need the parameters on the GPU; the plan was for the GPU
    for group in optimizer.param_groups:
        # same keys the optimizer's constructor takes: read by step() on every call
        group["foreach"] = impl == "foreach"
        if "fused" in group:
            group["fused"] = impl == "fused"
    return True


# ------------------------------------------------------------------------------------------------- the guard


def _lightning_steps_now(trainer: Any) -> bool:
    """Whether Lightning runs the optimizer step after this micro-batch: its own decision, which also knows the
    last batch of an epoch and the strategy. ``fit_loop._should_accumulate`` is private; checked on Lightning
    2.1-2.6."""
    should_accumulate = getattr(trainer.fit_loop, "_should_accumulate", None)
    if should_accumulate is None:
        raise UsageError("this Lightning version has no fit_loop._should_accumulate(), which memfit's DDP guard "
                         "reads; memfit was checked with Lightning 2.1-2.6. Pass guard=False.")
    return not should_accumulate()


class _Installed:
    """What the callback changed on the module and the trainer, to put back at the end of fit."""

    def __init__(self, pl_module: nn.Module, ddp: DistributedDataParallel | None, guard: WindowGuard) -> None:
        self.pl_module = pl_module
        self.ddp = ddp
        self.guard = guard
        self.previous = {name: vars(pl_module)[name] for name in _HOOKS if name in vars(pl_module)}

    def remove(self) -> None:
        for name in _HOOKS:
            vars(self.pl_module).pop(name, None)
            if name in self.previous:
                vars(self.pl_module)[name] = self.previous[name]
        if self.ddp is not None:
            self.ddp.require_backward_grad_sync = True


def _install_guard(lightning: ModuleType, trainer: Any, pl_module: Any, *,
                   splitter: microbatch.BatchSplitter | None, count_fn: microbatch.CountFn | None) -> _Installed:
    if not pl_module.automatic_optimization:
        raise UsageError("MemfitCallback's OOM guard runs with automatic optimization; this module optimizes "
                         "manually. Use memfit.TrainStep inside training_step, or pass guard=False.")
    strategy = trainer.strategy
    strategies = _submodule(lightning, "strategies")
    ddp = strategy.model if isinstance(strategy.model, DistributedDataParallel) else None
    if not isinstance(strategy, (strategies.SingleDeviceStrategy, strategies.DDPStrategy)) or (
            isinstance(strategy, strategies.DDPStrategy) and ddp is None and trainer.world_size > 1):
        raise UsageError(f"MemfitCallback's OOM guard supports single-device and DDP strategies, not "
                         f"{type(strategy).__name__}. Pass guard=False to keep only the plan and the explanation.")
    world = int(trainer.world_size)

    def agree(flag: bool) -> bool:
        return bool(strategy.reduce_boolean_decision(flag, all=False))  # "any": one rank's OOM stops them all

    guard = WindowGuard(pl_module, agree=agree if world > 1 else None, splitter=splitter, count_fn=count_fn)
    installed = _Installed(pl_module, ddp, guard)
    step_fn = pl_module.training_step
    backward_fn = pl_module.backward
    zero_grad_fn = pl_module.optimizer_zero_grad
    device_type = strategy.root_device.type
    if ddp is not None:
        # DDP reduces gradients inside backward; a rank that ran out of memory would leave the others waiting in
        # that all-reduce. The guard runs every backward without DDP's reducer and reduces once the ranks agreed.
        ddp.require_backward_grad_sync = False

    def training_step(batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Any:
        accumulate = int(trainer.accumulate_grad_batches)
        if batch_idx % accumulate == 0:
            # Lightning zeroes at these batches too, but after the forward; here it is before, so last window's
            # gradients are not alive during this forward, and not after the guard's backward
            for optimizer in trainer.optimizers:
                zero_grad_fn(trainer.current_epoch, batch_idx, optimizer)
            guard.begin_window()
        extras: dict[str, Any] = {}

        def piece(part: Any, weight: float) -> torch.Tensor | None:
            output = step_fn(part, batch_idx, *args, **kwargs)
            loss = _loss_of(output)
            if loss is None:
                return None
            if isinstance(output, Mapping):
                extras.update((k, v) for k, v in output.items() if k != "loss")
            del output
            # Lightning divides the step's loss by accumulate_grad_batches; weight = the piece's share
            scaled = loss * (weight / accumulate)
            scaler = getattr(trainer.precision_plugin, "scaler", None)  # 16-mixed's GradScaler
            if scaler is not None:
                scaled = scaler.scale(scaled)
            # Lightning runs backward outside the step's autocast region; so does the guard
            with torch.autocast(device_type=device_type, enabled=False):
                backward_fn(scaled)
            return loss.detach() * weight

        loss = guard.run(batch, piece)
        if ddp is not None and _lightning_steps_now(trainer):
            # what DDP's reducer would have done: the mean of the ranks' gradients, before clipping/unscaling
            reduce_gradients(pl_module.parameters(), ddp.process_group, factor=1.0 / world)
        if loss is None:
            return None
        return {"loss": loss, **extras} if extras else loss

    def no_backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        return None  # the guard ran this micro-batch's backward inside training_step, piece by piece

    def no_zero_grad(epoch: int, batch_idx: int, optimizer: Any) -> None:
        return None  # the guard zeroed at the window's first micro-batch, before its forward

    vars(pl_module)["training_step"] = training_step
    vars(pl_module)["backward"] = no_backward
    vars(pl_module)["optimizer_zero_grad"] = no_zero_grad
    return installed


# ---------------------------------------------------------------------------------------------- the callback


class MemfitCallbackBase:
    """The hooks of ``MemfitCallback``, on no Lightning package yet; the modules ``memfit.integrations.lightning``
    and ``memfit.integrations.pytorch_lightning`` put them on their package's ``Callback`` (a Trainer accepts only
    callbacks of its own package).

    Args:
        budget: Device memory this process may use ("24GiB", "24GB" = 24e9, or bytes), CUDA context included;
            None plans nothing (the guard and the explanation still run).
        gpu: The GPU to plan for (a name such as "h100", or a ``GpuSpec``); default the CUDA device training runs
            on, else an H100.
        effective_batch: Samples per optimizer step to keep; default the batch-size attribute ×
            ``accumulate_grad_batches`` as configured.
        batch_arg_name: The attribute of the LightningModule or its datamodule that the train dataloader reads
            its batch size from (``BatchSizeFinder``'s ``batch_arg_name``).
        allow_precision_change: Let the plan switch fp32 training to bf16 autocast (changes numerics).
        guard: Survive an OOM in a training step by running the window again in smaller pieces.
        count_fn: Units the loss of ``training_step`` averages over when not samples
            (``memfit.count_tokens("labels")``): the weights of the pieces after an OOM.
        splitter: How to cut custom batch types (``memfit.BatchSplitter``).
        margin: The plan keeps its predicted need below ``budget × (1 - margin)``.
        explain_oom: Attach memfit's diagnosis to an OOM that ends ``fit``.
    """

    lightning: ClassVar[ModuleType]
    """``lightning.pytorch`` or ``pytorch_lightning``: the package whose Trainer runs this callback."""

    def __init__(
        self,
        budget: str | int | None = None,
        *,
        gpu: str | GpuSpec | None = None,
        effective_batch: int | None = None,
        batch_arg_name: str = "batch_size",
        allow_precision_change: bool = False,
        guard: bool = True,
        count_fn: microbatch.CountFn | None = None,
        splitter: microbatch.BatchSplitter | None = None,
        margin: float = DEFAULT_MARGIN,
        explain_oom: bool = True,
    ) -> None:
        super().__init__()
        self.budget_bytes = parse_bytes(budget) if budget is not None else None
        if effective_batch is not None and (isinstance(effective_batch, bool) or
                                            not hasattr(type(effective_batch), "__index__") or
                                            operator.index(effective_batch) < 1):
            raise UsageError(f"effective_batch must be a positive integer or None, got {effective_batch!r}.")
        if not isinstance(batch_arg_name, str) or not batch_arg_name:
            raise UsageError(f"batch_arg_name must name an attribute, got {batch_arg_name!r}.")
        for flag_name, flag in (("allow_precision_change", allow_precision_change), ("guard", guard),
                                ("explain_oom", explain_oom)):
            if not isinstance(flag, bool):
                raise UsageError(f"{flag_name} must be True or False, got {flag!r}.")
        self.gpu = gpu
        self.effective_batch = None if effective_batch is None else operator.index(effective_batch)
        self.batch_arg_name = batch_arg_name
        self.allow_precision_change = allow_precision_change
        self.guard = guard
        self.count_fn = count_fn
        self.splitter = splitter
        self.margin = margin
        self.explain_oom = explain_oom
        self.plan: Plan | None = None
        """The plan applied at the last ``fit`` (None without a budget)."""
        self.workload: Workload | None = None
        """The workload the plan was made for, as the module was configured before the plan."""
        self.window_guard: WindowGuard | None = None
        """The guard of the current or last ``fit`` (its ``ooms``, its piece ``size``)."""
        self._installed: _Installed | None = None

    # -- Lightning hooks ------------------------------------------------------------------------------------

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self.budget_bytes is not None:
            self.plan = self._plan(trainer, pl_module)
            self._apply(trainer, pl_module, self.plan)
        if self.guard:
            self._installed = _install_guard(self.lightning, trainer, pl_module, splitter=self.splitter,
                                             count_fn=self.count_fn)
            self.window_guard = self._installed.guard

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._remove()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._remove()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._remove()
        if not self.explain_oom:
            return
        report = oom_report(exception, estimate=self._estimate_for_report(exception))
        if report is None:
            return
        if hasattr(exception, "add_note"):  # Python >= 3.11: printed under the traceback, as one block
            exception.add_note(report)
        else:
            logger.error("%s", report)

    # -- helpers --------------------------------------------------------------------------------------------

    def _remove(self) -> None:
        if self._installed is not None:
            self._installed.remove()
            self._installed = None

    def _plan(self, trainer: Any, pl_module: Any) -> Plan:
        parsing = _submodule(self.lightning, "utilities.parsing")
        if not parsing.lightning_hasattr(pl_module, self.batch_arg_name):
            raise UsageError(
                f"MemfitCallback sets the micro-batch through the attribute {self.batch_arg_name!r} of the "
                "LightningModule or its datamodule (as BatchSizeFinder does), and neither has it. Add it and read "
                "it in train_dataloader(), pass batch_arg_name=..., or pass budget=None."
            )
        micro = parsing.lightning_getattr(pl_module, self.batch_arg_name)
        if isinstance(micro, bool) or not hasattr(type(micro), "__index__") or operator.index(micro) < 1:
            raise UsageError(f"the batch-size attribute {self.batch_arg_name!r} is {micro!r}, not a positive "
                             "integer.")
        effective = self.effective_batch or operator.index(micro) * int(trainer.accumulate_grad_batches)
        workload = workload_from_lightning(trainer, pl_module, _first_batch(trainer, pl_module))
        self.workload = workload
        gpu = self.gpu
        if gpu is None and trainer.strategy.root_device.type == "cuda":
            gpu = detect_gpu()
        assert self.budget_bytes is not None  # only called with a budget
        chosen = plan(workload, budget_bytes=self.budget_bytes, effective_batch=effective, gpu=gpu,
                      allow_precision_change=self.allow_precision_change, margin=self.margin,
                      calibration=per_rank_choice(int(trainer.world_size)))
        logger.info("memfit plan for %s under %s: %s (predicted %s)", workload.name,
                    format_bytes(self.budget_bytes), chosen.chosen.config.label(),
                    format_bytes(chosen.chosen.device_bytes))
        return chosen

    def _apply(self, trainer: Any, pl_module: Any, chosen: Plan) -> None:
        """Set the module and the trainer as planned."""
        config = chosen.chosen.config
        _submodule(self.lightning, "utilities.parsing").lightning_setattr(
            pl_module, self.batch_arg_name, config.micro_batch)
        trainer.accumulate_grad_batches = config.accumulation_steps
        if config.checkpoint:
            apply_checkpointing(pl_module, config.checkpoint, config.checkpoint_mode)
        if config.loss_impl == "chunked":  # offered only where the module itself is shaped like a causal LM
            use_chunked_cross_entropy(pl_module)
        if config.optimizer_impl != "default":
            for optimizer in trainer.optimizers:
                if not _set_optimizer_impl_in_place(optimizer, config.optimizer_impl):
                    logger.info("kept %s's implementation: %r does not apply here", type(optimizer).__name__,
                                config.optimizer_impl)
        if config.channels_last:  # .to keeps the Parameter objects, so the optimizer still holds them
            is_3d = any(p.dim() == 5 for p in pl_module.parameters())
            pl_module.to(memory_format=torch.channels_last_3d if is_3d else torch.channels_last)
        workload = self.workload
        if workload is not None and config.precision != workload.precision:  # only with allow_precision_change
            mixed = _submodule(self.lightning, "plugins.precision").MixedPrecision
            flag = _LIGHTNING_FLAG[config.precision]
            trainer.strategy.precision_plugin = mixed(flag, device=trainer.strategy.root_device.type)
        if config.expandable_segments:
            logger.warning("the plan assumes PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; set it before the "
                           "process starts (it cannot change once CUDA is initialised).")

    def _estimate_for_report(self, exception: BaseException) -> Estimate | None:
        if self.workload is None or self.plan is None or oom_report(exception) is None:
            return None
        with contextlib.suppress(Exception), warnings.catch_warnings():  # a courtesy: never mask the user's error
            warnings.simplefilter("ignore")
            return estimate(self.plan.workload_for(self.workload).replace(keep_output=False))
        return None


def _submodule(package: ModuleType, name: str) -> ModuleType:
    return importlib.import_module(f"{package.__name__}.{name}")


try:
    import lightning.pytorch as _pl
except ImportError:  # the older package name; same API in 2.x
    try:
        import pytorch_lightning as _pl  # type: ignore[no-redef]
    except ImportError as exc:
        raise MissingExtraError(
            "memfit's Lightning integration needs lightning (or pytorch_lightning) >= 2.1, which is not installed. "
            "Install it with: pip install 'memfit[integrations]'"
        ) from exc


class MemfitCallback(MemfitCallbackBase, _pl.Callback):
    """Plan the micro-batch under a budget, survive an OOM in ``training_step``, explain one that ends ``fit``.

    ``lightning.pytorch``'s ``Callback`` (``pytorch_lightning``'s when only that is installed; for a
    ``pytorch_lightning`` Trainer use ``memfit.integrations.pytorch_lightning.MemfitCallback``). Arguments: see
    :class:`MemfitCallbackBase`.

    Example::

        trainer = L.Trainer(callbacks=[MemfitCallback(budget="24GiB")])
    """

    lightning: ClassVar[ModuleType] = _pl
