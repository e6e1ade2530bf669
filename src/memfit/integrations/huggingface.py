"""memfit in a Hugging Face ``Trainer``: a plan as ``TrainingArguments``, and a Trainer that survives an OOM.

Example (not run here: it needs ``pip install 'memfit[integrations]'``)::

    from memfit.integrations.huggingface import MemfitTrainer, plan_training_arguments

    args, summary = plan_training_arguments(model, args, batch, budget="24GiB")  # batch: one collated batch
    print(summary)
    MemfitTrainer(model=model, args=args, train_dataset=train_dataset).train()

``plan_training_arguments`` plans the model's step (its ``loss`` output, the optimizer ``args.optim`` names, the
precision of ``args``) for the effective batch ``per_device_train_batch_size × gradient_accumulation_steps`` and
returns ``args`` updated with ``dataclasses.replace``: the micro-batch, the accumulation, gradient checkpointing,
the fused AdamW, and bf16 only with ``allow_precision_change``; where the plan chose the chunked cross-entropy
(a causal LM whose logits dominate), it is swapped into ``model`` in place.

``MemfitTrainer`` overrides ``training_step``: a micro-batch that runs out of memory (in forward, loss or
backward) rolls the accumulation window back and runs it again with the inputs split along the batch dimension
(``memfit.integrations.window``). The pieces keep the Trainer's loss normalisation: with ``num_items_in_batch``
(the model takes loss kwargs) each piece's loss is already a sum over the window's item count; otherwise each
piece's mean is weighted by its share of the counted label tokens (shifted for causal LMs, as the Trainer counts
them). Under DDP the ranks agree through Accelerate's ``reduce`` and reduce gradients once, after agreeing.
docs/integrations.md says what is and is not promised.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from memfit.errors import MissingExtraError, UsageError
from memfit.estimate.cuda_emulation import deterministic_algorithms
from memfit.estimate.gpus import GpuSpec, detect_gpu
from memfit.guard import microbatch
from memfit.guard.agreement import reduce_gradients
from memfit.integrations.module_workload import batch_factory, meta_copy, model_factory
from memfit.integrations.window import WindowGuard
from memfit.plan.records import Plan
from memfit.plan.search import DEFAULT_MARGIN, plan
from memfit.speed.model_choice import per_rank_choice
from memfit.units import format_bytes, parse_bytes
from memfit.workload.chunked_cross_entropy import use_chunked_cross_entropy
from memfit.workload.spec import Precision, Workload

try:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
except ImportError as exc:
    raise MissingExtraError(
        "memfit's Hugging Face integration needs transformers >= 4.46, which is not installed. Install it with: "
        "pip install 'memfit[integrations]'"
    ) from exc

__all__ = ["MemfitTrainer", "plan_training_arguments", "training_arguments_for", "workload_from_model"]

logger = logging.getLogger(__name__)

# TrainingArguments.optim values that run torch.optim.AdamW: the plan may switch between its implementations
_TORCH_ADAMW = ("adamw_torch", "adamw_torch_fused")
_IGNORE_INDEX = -100  # the label value Hugging Face losses ignore (CrossEntropyLoss's default ignore_index)


def _precision_of(args: Any) -> Precision:
    if getattr(args, "bf16", False):
        return "bf16"
    if getattr(args, "fp16", False):
        return "fp16"
    return "fp32"


# -------------------------------------------------------------------------------------------------- planning


def workload_from_model(model: torch.nn.Module, args: Any, batch: Mapping[str, Any], *,
                        name: str | None = None) -> Workload:
    """The step a ``Trainer`` with ``args`` runs on ``model``, as a memfit ``Workload`` (no weights copied).

    ``batch`` is one collated batch (a dict with ``labels``, as the Trainer's collator gives it); its size is the
    micro-batch. The loss is the model's ``loss`` output; the optimizer is ``torch.optim.AdamW`` with the
    learning rate, betas, epsilon and weight decay of ``args`` (for another ``args.optim`` the plan models AdamW's
    two states per parameter, and says so in the summary).

    Raises:
        UsageError: ``batch`` is not a dict of tensors with labels.
    """
    if not isinstance(batch, Mapping) or "labels" not in batch:
        raise UsageError("memfit plans a Trainer step from one collated batch: a dict of tensors with 'labels', as "
                         f"the Trainer's data collator returns it; got {type(batch).__name__}"
                         + (" without 'labels'." if isinstance(batch, Mapping) else "."))
    make_batch, size = batch_factory(dict(batch))
    settings = {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon,
                "weight_decay": args.weight_decay}
    if str(getattr(args.optim, "value", args.optim)) == "adamw_torch_fused":
        settings["fused"] = True
    return Workload(
        model=model_factory(meta_copy(model)),
        batch=make_batch,
        loss=lambda out, b: out["loss"] if isinstance(out, Mapping) else out[0],
        optimizer=lambda params: torch.optim.AdamW(params, **settings),
        batch_size=size,
        accumulation_steps=int(args.gradient_accumulation_steps),
        precision=_precision_of(args),
        keep_output=False,  # compute_loss returns the loss; the outputs are dropped before backward
        name=name or type(model).__name__,
    )


def training_arguments_for(chosen: Plan, args: Any, *, trained_precision: Precision | None = None,
                           model: torch.nn.Module | None = None) -> tuple[Any, str]:
    """``args`` updated to run ``chosen`` (``dataclasses.replace``), and what changed, in words.

    Args:
        chosen: A plan of the model's step (``plan_training_arguments`` makes one).
        args: The ``TrainingArguments`` to update; they are not modified.
        trained_precision: The precision ``args`` trains in (default: read from ``args``); bf16/fp16 are set only
            where the plan chose another precision, which it does only with ``allow_precision_change``.
        model: The model the Trainer trains. Where the plan chose the chunked cross-entropy (no
            ``TrainingArguments`` field says it), it is swapped into this model in place
            (``use_chunked_cross_entropy``); without a model the summary says to do it.

    Example:
        ``args, summary = training_arguments_for(memfit.plan(workload, budget_bytes=24 << 30), args)``
    """
    config = chosen.chosen.config
    before = trained_precision or _precision_of(args)
    changes: dict[str, Any] = {
        "per_device_train_batch_size": config.micro_batch,
        "gradient_accumulation_steps": config.accumulation_steps,
    }
    lines = [f"memfit plan under {format_bytes(chosen.budget_bytes)} on {chosen.gpu}: {config.label()} "
             f"(predicted {format_bytes(chosen.chosen.device_bytes)})",
             f"  per_device_train_batch_size {args.per_device_train_batch_size} -> {config.micro_batch}",
             f"  gradient_accumulation_steps {args.gradient_accumulation_steps} -> {config.accumulation_steps}"]
    # transformers >= 5 names the flag activation_checkpointing (gradient_checkpointing is its deprecated alias,
    # ignored by dataclasses.replace once the new name is set)
    flag = ("activation_checkpointing" if "activation_checkpointing" in {f.name for f in dataclasses.fields(args)}
            else "gradient_checkpointing")
    if config.checkpoint:
        changes[flag] = True
        lines.append(f"  {flag} -> True (the plan checkpoints {len(config.checkpoint)} blocks: "
                     f"{', '.join(config.checkpoint[:3])}{', ...' if len(config.checkpoint) > 3 else ''}; the "
                     "Trainer's flag checkpoints every layer, which needs no more memory and costs more time)")
        if config.checkpoint_mode != "full":
            lines.append(f"  the plan's {config.checkpoint_mode} checkpointing has no Trainer flag: the Trainer "
                         "checkpoints fully (less memory, its own speed); plan with checkpoint_modes=('full',) to match")
    elif getattr(args, flag, False):
        lines.append(f"  {flag} stays on (the plan fits without it; turning it off would be faster)")
    optim_now = str(getattr(args.optim, "value", args.optim))  # an OptimizerNames enum, or its string
    if optim_now in _TORCH_ADAMW:
        optim = "adamw_torch_fused" if config.optimizer_impl == "fused" else "adamw_torch"
        if optim != optim_now and config.optimizer_impl != "default":
            changes["optim"] = optim
            lines.append(f"  optim {optim_now} -> {optim}")
    else:
        lines.append(f"  optim stays {optim_now!r}: memfit planned it as torch AdamW (two states per parameter)")
    if config.precision != before:
        changes["bf16" if config.precision == "bf16" else "fp16"] = True
        lines.append(f"  {config.precision} autocast -> on (allowed by allow_precision_change)")
    if config.loss_impl == "chunked":
        if model is not None:
            use_chunked_cross_entropy(model)
            lines.append("  loss -> chunked cross-entropy, swapped into the model (no full logits; the loss is the "
                         "same and outputs.logits is None)")
        else:
            lines.append("  call memfit.workload.chunked_cross_entropy.use_chunked_cross_entropy(model) before "
                         "training: the plan's memory assumes the chunked cross-entropy")
    if config.expandable_segments:
        lines.append("  set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the process starts")
    return dataclasses.replace(args, **changes), "\n".join(lines)


def plan_training_arguments(
    model: torch.nn.Module,
    args: Any,
    batch: Mapping[str, Any],
    *,
    budget: str | int,
    effective_batch: int | None = None,
    gpu: str | GpuSpec | None = None,
    allow_precision_change: bool = False,
    margin: float = DEFAULT_MARGIN,
) -> tuple[Any, str]:
    """Plan ``model``'s training step under ``budget`` and return ``args`` updated to run the plan, and a summary.

    Args:
        model: The model the Trainer trains (anywhere: its weights are not copied).
        args: Its ``TrainingArguments``.
        batch: One collated batch (``next(iter(trainer.get_train_dataloader()))``): the shapes to plan for.
        budget: Device memory per process ("24GiB", "24GB" = 24e9, or bytes), CUDA context included.
        effective_batch: Samples per optimizer step per device; default ``per_device_train_batch_size ×
            gradient_accumulation_steps`` of ``args``.
        gpu: The GPU to plan for; default this machine's CUDA device, else an H100.
        allow_precision_change: Let the plan switch fp32 training to bf16 autocast (changes numerics).
        margin: The plan keeps its predicted need below ``budget × (1 - margin)``.

    Raises:
        BudgetTooSmallError: nothing fits; the message gives the smallest configuration's need.
    """
    budget_bytes = parse_bytes(budget)
    effective = (int(args.per_device_train_batch_size) * int(args.gradient_accumulation_steps)
                 if effective_batch is None else operator.index(effective_batch))
    workload = workload_from_model(model, args, batch)
    with _as_the_trainer_sets(args):
        chosen = plan(workload, budget_bytes=budget_bytes, effective_batch=effective,
                      gpu=gpu if gpu is not None else detect_gpu(), allow_precision_change=allow_precision_change,
                      margin=margin, calibration=per_rank_choice(int(getattr(args, "world_size", 1))),
                      checkpoint_modes=("full",))  # the Trainer's flag checkpoints fully, non-reentrant
    return training_arguments_for(chosen, args, trained_precision=workload.precision, model=model)


@contextlib.contextmanager
def _as_the_trainer_sets(args: Any) -> Iterator[None]:
    """The process-wide settings a ``Trainer`` makes from ``args`` before it trains, in force for the plan's traces
    (which may run before the Trainer exists), then given back. With ``full_determinism``, transformers'
    ``enable_full_determinism`` turns deterministic algorithms on and cuDNN's benchmark mode off, and the trace takes
    the paths CUDA then takes (bilinear upsampling's decomposition, the index ops' sorts; ``memfit.estimate``).
    Warn-only here: the traces run no CUDA kernel, and a real CPU forward (a detector's sizes) must not stop on an
    op that the GPU would run."""
    if not getattr(args, "full_determinism", False):
        yield
        return
    with deterministic_algorithms(True, cudnn_benchmark=False):
        yield


# ------------------------------------------------------------------------------------------------- the guard


@contextlib.contextmanager
def _weighted_backward(accelerator: Any, weight: float) -> Iterator[None]:
    """``accelerator.backward`` multiplies the loss by ``weight`` first (the piece's share of the micro-batch)."""
    if weight == 1.0:
        yield
        return
    own = vars(accelerator).get("backward")  # an instance attribute someone else put there, kept
    original = accelerator.backward

    def backward(loss: torch.Tensor, **kwargs: Any) -> Any:
        return original(loss * weight, **kwargs)

    vars(accelerator)["backward"] = backward
    try:
        yield
    finally:
        if own is None:
            vars(accelerator).pop("backward", None)
        else:
            vars(accelerator)["backward"] = own


class MemfitTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` whose ``training_step`` survives an OOM with the same gradients.

    Args:
        *args: As ``transformers.Trainer``.
        memfit_count_fn: Units each micro-batch's loss is a mean over, when the Trainer does not normalise by
            ``num_items_in_batch``; default the counted label tokens (as the Trainer counts them), else samples.
        memfit_splitter: How to cut custom inputs (``memfit.BatchSplitter``); default dicts of tensors along
            dimension 0.
        **kwargs: As ``transformers.Trainer``.

    Example::

        MemfitTrainer(model=model, args=args, train_dataset=train_dataset).train()
    """

    def __init__(self, *args: Any, memfit_count_fn: microbatch.CountFn | None = None,
                 memfit_splitter: microbatch.BatchSplitter | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.memfit_count_fn = memfit_count_fn
        self.memfit_splitter = memfit_splitter
        self.memfit_guard: WindowGuard | None = None
        """The guard (its ``ooms``, its piece ``size``), made at the first training step."""
        self._memfit_window: int | None = None

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        guard = self._memfit_guard(model)
        if self._memfit_window != self.state.global_step:  # the window's first micro-batch: gradients are zeroed
            self._memfit_window = self.state.global_step
            guard.begin_window()
        normalized = self._memfit_loss_is_normalized(num_items_in_batch)
        parent_step = super().training_step
        ddp = model if isinstance(model, DistributedDataParallel) else None

        def piece(part: Any, weight: float) -> torch.Tensor:
            # normalised by the window's item count, a piece's loss is already its share; a mean needs the weight
            share = 1.0 if normalized else weight
            # under DDP no backward reduces: a rank out of memory would leave the others waiting in that reduce
            no_sync = self.accelerator.no_sync(model) if ddp is not None else contextlib.nullcontext()
            with _weighted_backward(self.accelerator, share), no_sync:
                loss = parent_step(model, part, num_items_in_batch)
            return loss.detach() * share

        loss = guard.run(inputs, piece)
        if ddp is not None and self.accelerator.sync_gradients:
            # what DDP's reducer would have done: the mean of the ranks' gradients, once they agreed
            reduce_gradients(ddp.module.parameters(), ddp.process_group, factor=1.0 / ddp.process_group.size())
        assert loss is not None  # the Trainer's step always returns a loss
        return loss

    # -- helpers --------------------------------------------------------------------------------------------

    def _memfit_guard(self, model: torch.nn.Module) -> WindowGuard:
        if self.memfit_guard is None:
            distributed = str(self.accelerator.distributed_type)
            if self.accelerator.num_processes > 1 and not isinstance(model, DistributedDataParallel):
                raise UsageError(f"MemfitTrainer's OOM guard runs on one process or under DDP, not {distributed}: "
                                 "use transformers.Trainer for FSDP or DeepSpeed.")
            module = model.module if isinstance(model, DistributedDataParallel) else model
            self.memfit_guard = WindowGuard(
                module, agree=self._memfit_agree if self.accelerator.num_processes > 1 else None,
                splitter=self.memfit_splitter, count_fn=self.memfit_count_fn or self._memfit_count,
            )
        return self.memfit_guard

    def _memfit_agree(self, flag: bool) -> bool:
        """Any rank's flag, through Accelerate's own reduce (one small all-reduce)."""
        total = self.accelerator.reduce(torch.tensor([float(flag)], device=self.args.device), reduction="sum")
        return bool(total.item() > 0)

    def _memfit_loss_is_normalized(self, num_items_in_batch: Any) -> bool:
        """Whether the Trainer's loss is already a sum over the window's items (the Trainer's own rule)."""
        scaled = getattr(self, "loss_is_scaled_for_ga", None)  # a subclass says so itself (transformers >= 5)
        if scaled is not None:
            return bool(scaled)
        return bool((self.model_accepts_loss_kwargs and num_items_in_batch is not None)
                    or self.compute_loss_func is not None)

    def _memfit_shifts_labels(self) -> bool:
        """Whether the model's loss drops each row's first label: a causal LM (the Trainer's own flag, or the
        model's class in transformers' causal-LM mapping, as its ``compute_loss`` decides for label smoothing)."""
        if getattr(self, "_loss_shifts_labels", False):
            return True
        model = self.accelerator.unwrap_model(self.model)
        config = getattr(model, "config", None)
        return (type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
                and not getattr(config, "is_encoder_decoder", False))

    def _memfit_count(self, part: Mapping[str, Any]) -> int | torch.Tensor:
        """What a mean loss averages over: label tokens the loss counts (shifted for causal LMs), else samples."""
        labels = part.get("shift_labels") if isinstance(part, Mapping) else None
        if labels is None and isinstance(part, Mapping) and isinstance(part.get("labels"), torch.Tensor):
            labels = part["labels"]
            if labels.dim() > 1 and self._memfit_shifts_labels():
                labels = labels[..., 1:]  # a causal LM predicts label i+1 at position i: row i's first is no target
        if labels is None:
            return microbatch.batch_size(part)
        return (labels != _IGNORE_INDEX).sum()
