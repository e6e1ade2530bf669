"""The knobs memfit turns on a training step without changing its mathematics.

Activation checkpointing of chosen blocks (full, selective or reentrant) and the optimizer's implementation (foreach / for-loop / fused) are
applied to the model and optimizer the user's factories build, so ``estimate``, ``measure``, ``explain``, ``plan``
and the guarded step all wrap them the same way.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from memfit.errors import WorkloadError
from memfit.workload.chunked_cross_entropy import output_head
from memfit.workload.optimizer_state import optimizer_states_for
from memfit.workload.selective_checkpoint import selective_contexts
from memfit.workload.spec import (
    CHECKPOINT_MODES,
    OPTIMIZER_IMPLS,
    CheckpointMode,
    LossImpl,
    OptimizerImpl,
    OptimizerState,
    Workload,
)

_CHECKPOINTED = "_memfit_checkpointed"
_INDEX = re.compile(r"^\d+$")


def apply_checkpointing(model: torch.nn.Module, names: Iterable[str], mode: CheckpointMode = "full") -> torch.nn.Module:
    """Run the forward of each named submodule under ``torch.utils.checkpoint``, in place.

    ``mode`` (``Workload.checkpoint_mode`` says what each costs): ``full`` keeps only the block's inputs and
    recomputes everything inside it in backward (about one extra forward of the block); ``selective`` also keeps
    the outputs of its matmuls, convolutions and attention kernels and recomputes the rest; ``reentrant`` is
    ``full`` through ``use_reentrant=True``. BatchNorm running statistics inside a checkpointed block are updated
    twice per step, because the recompute runs the block in training mode again.
    """
    if mode not in CHECKPOINT_MODES:
        raise WorkloadError(f"checkpoint mode must be one of {', '.join(CHECKPOINT_MODES)}, got {mode!r}.")
    modules = dict(model.named_modules())
    for name in names:
        module = modules.get(name)
        if module is None:
            close = [n for n in modules if n.endswith(name.rsplit(".", 1)[-1])][:5]
            raise WorkloadError(
                f"cannot checkpoint {name!r}: the model has no such submodule. Names look like: "
                f"{', '.join(close) or ', '.join(list(modules)[1:6])}."
            )
        if module is model:
            raise WorkloadError("cannot checkpoint the whole model: name its blocks (e.g. 'layers.0').")
        done = getattr(module, _CHECKPOINTED, None)
        if done == mode:
            continue
        if done is not None:
            raise WorkloadError(f"{name!r} is checkpointed ({done}) already; build the model again to use {mode}.")
        module.forward = _checkpointed(module.forward, name, mode)  # type: ignore[method-assign]
        setattr(module, _CHECKPOINTED, mode)
    return model


def _checkpointed(forward: Any, name: str, mode: CheckpointMode) -> Any:
    from torch.utils.checkpoint import checkpoint

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation and the recompute itself: nothing to save
            return forward(*args, **kwargs)
        if mode == "selective":
            return checkpoint(forward, *args, use_reentrant=False, context_fn=selective_contexts, **kwargs)
        if mode == "full":
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return _reentrant(forward, name, args, kwargs)

    return run


def _reentrant(forward: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``forward(*args, **kwargs)`` under reentrant checkpointing, which takes positional tensors only."""
    from torch.utils.checkpoint import checkpoint

    needs_grad = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
    if needs_grad:
        # reentrant checkpointing differentiates through its positional inputs only: a keyword tensor's gradient
        # would be lost (or computed twice through the outer graph)
        raise WorkloadError(
            f"cannot checkpoint {name!r} reentrantly: its keyword argument(s) {', '.join(needs_grad)} need gradients, "
            "and reentrant checkpointing passes only positional inputs. Use checkpoint_mode='full'."
        )
    call = functools.partial(forward, **kwargs) if kwargs else forward
    if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return checkpoint(call, *args, use_reentrant=True)
    # no input needs a gradient (the block's input is the batch): reentrant checkpointing would then give its
    # parameters none. A zero-size input that needs one (no memory) makes its backward run.
    dummy = torch.empty(0, requires_grad=True)
    return checkpoint(lambda _, *a: call(*a), dummy, *args, use_reentrant=True)


def checkpoint_candidates(model: torch.nn.Module) -> list[str]:
    """The model's blocks, in forward-definition order: the outermost modules held by a ModuleList/Sequential.

    These are the units users checkpoint (transformer layers, ResNet bottlenecks, U-Net stages). A block must
    own parameters; blocks nested inside another block are not listed.
    """
    blocks: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(b + ".") for b in blocks):
            continue
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if not _INDEX.match(leaf) or not isinstance(parent, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        if parent is model or not any(True for _ in module.parameters()):
            continue  # the whole model, or a parameter-free layer (ReLU): nothing worth recomputing
        if not any(True for _ in module.children()):
            continue  # a single layer keeps its input anyway: checkpointing it saves little
        blocks.append(name)
    return blocks


def block_of(name: str) -> str:
    """The block a module belongs to: its name up to the first list index (``decoder.2.0.conv`` -> ``decoder.2``)."""
    parts = name.split(".")
    for i, p in enumerate(parts):
        if _INDEX.match(p):
            return ".".join(parts[: i + 1])
    return parts[0] if parts else name


def activations_by_block(by_module: dict[str, int]) -> dict[str, int]:
    """``Estimate.activations_by_module`` summed per block, largest first (``(loss)``-style names kept)."""
    out: dict[str, int] = {}
    for name, nbytes in by_module.items():
        key = name if name.startswith("(") else block_of(name)
        out[key] = out.get(key, 0) + nbytes
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


SAME_SIZE_BLOCKS = 0.02
"""Blocks whose activations lie within this fraction of each other count as one size when choosing which to
checkpoint. A repeated block's estimate varies by well under it (ViT-B/16's twelve: 189.0-190.3 MB at micro-batch
32), and ranking by those bytes picked a scattered set: at a 4 GiB budget nine of them, {0-6, 9, 11}, needed
4.14 GiB where {0-8} needs 3.88 (its upper bound, H200), so the plan checkpointed all twelve."""


def checkpoint_choices(by_module: dict[str, int], blocks: Iterable[str],
                       shares: tuple[float, ...] = (0.5,)) -> list[tuple[str, ...]]:
    """What to checkpoint: for each share, the fewest blocks holding that share of the blocks' activations
    (heaviest first), then all blocks that hold any; each in forward order, without repeats.

    Among blocks of about one size (``SAME_SIZE_BLOCKS``) the earlier go first: backward frees a later block's
    activations before it reaches an earlier one, so with the last blocks left plain their activations are gone by
    the first recompute, where a plain block among checkpointed ones is still alive at each later block's."""
    order = list(blocks)
    held = activations_by_block(by_module)
    by_size = sorted((b for b in order if held.get(b, 0) > 0), key=lambda b: -held[b])
    if not by_size:
        return []
    # which blocks: tiers of about one size, heaviest first, forward order within a tier
    ranked: list[str] = []
    left = list(by_size)
    while left:
        tier = [b for b in left if held[b] >= held[left[0]] * (1 - SAME_SIZE_BLOCKS)]
        ranked += sorted(tier, key=order.index)
        left = [b for b in left if b not in tier]
    total = sum(held[b] for b in by_size)
    chosen: list[set[str]] = []
    for share in sorted(shares):
        # how many: the fewest that hold the share, heaviest first
        acc, count = 0, 0
        for b in by_size:
            count += 1
            acc += held[b]
            if acc >= total * share:
                break
        chosen.append(set(ranked[:count]))
    in_order = [tuple(b for b in order if b in c) for c in (*chosen, set(ranked))]
    return list(dict.fromkeys(in_order))


def set_optimizer_impl(optimizer: torch.optim.Optimizer, impl: str) -> torch.optim.Optimizer:
    """Rebuild ``optimizer`` with the same parameter groups and settings but another implementation.

    ``foreach`` batches the update over all parameters (fast; temporaries about the size of the parameters),
    ``for-loop`` updates one parameter at a time (slow; tiny temporaries), ``fused`` runs one kernel per group
    (fastest; no temporaries). The mathematics is the same up to floating-point rounding.
    """
    if impl == "default":
        return optimizer
    if impl not in OPTIMIZER_IMPLS:
        raise WorkloadError(f"optimizer implementation must be one of {', '.join(OPTIMIZER_IMPLS)}, got {impl!r}.")
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    key = "fused" if impl == "fused" else "foreach"
    if key not in accepted:
        raise WorkloadError(f"{cls.__name__} has no {key!r} option, so {impl!r} cannot be chosen for it.")
    flags = {"foreach": impl == "foreach"}
    if "fused" in accepted:
        flags["fused"] = impl == "fused"
    if impl == "fused":
        flags["foreach"] = False
    groups = [{**group, **flags} for group in optimizer.param_groups]
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}
    defaults.update(flags)
    try:
        return cls(groups, **defaults)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise WorkloadError(f"{cls.__name__} cannot run {impl!r} here: {exc}") from exc


def optimizer_impls_for(optimizer: torch.optim.Optimizer) -> list[OptimizerImpl]:
    """The implementations ``set_optimizer_impl`` can give this optimizer class."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return [i for i in ("foreach", "for-loop", "fused") if ("fused" if i == "fused" else "foreach") in accepted]


def default_impl_on_cuda(optimizer: torch.optim.Optimizer) -> OptimizerImpl | None:
    """The implementation a ``torch.optim`` optimizer left as the user built it runs on CUDA parameters: fused or
    for-loop where every group asks for it, else foreach, torch's choice where neither flag is set
    (``torch.optim.optimizer._default_to_fused_or_foreach``; the trace makes the same choice,
    ``memfit.estimate.trace_setup.cuda_default_optimizer``). None where memfit cannot tell: another library's optimizer,
    groups that differ, a differentiable optimizer."""
    if not type(optimizer).__module__.startswith("torch.optim."):
        return None
    found: set[OptimizerImpl] = set()
    for group in optimizer.param_groups:
        if group.get("differentiable"):
            return None
        found.add("fused" if group.get("fused") else "for-loop" if group.get("foreach") is False else "foreach")
    return found.pop() if len(found) == 1 else None


@dataclass(frozen=True)
class ModelFacts:
    """What the fixes and the planner need to know about a model: which knobs apply to it."""

    has_batchnorm: bool
    has_conv: bool
    blocks: tuple[str, ...]
    optimizer_impls: tuple[OptimizerImpl, ...]
    output_vocab: int | None = None
    """The output layer's width where the chunked cross-entropy can be swapped in (an HF-shaped causal LM)."""
    optimizer_states: tuple[OptimizerState, ...] = ("full",)
    """The ``Workload.optimizer_state`` values the optimizer takes: all three for Adam/AdamW."""
    default_impl: OptimizerImpl | None = None
    """What ``optimizer_impl="default"`` runs on the GPU (``default_impl_on_cuda``); None where memfit cannot tell."""

    @property
    def loss_impls(self) -> tuple[LossImpl, ...]:
        """The ``Workload.loss_impl`` values this model takes: ``chunked`` only where memfit finds its output layer."""
        return ("default", "chunked") if self.output_vocab is not None else ("default",)


def model_facts(workload: Workload) -> ModelFacts:
    """What the fixes need to know about the model, from building it on the meta device (no memory)."""
    try:
        with torch.device("meta"):
            model = workload.model()
            optimizer = workload.optimizer(model.parameters())
            impls = tuple(optimizer_impls_for(optimizer))
            default = default_impl_on_cuda(optimizer) if impls else None
            states = optimizer_states_for(optimizer)
            head = output_head(model)
    except Exception:  # a factory that cannot build on meta: offer only the fixes that need no model facts
        return ModelFacts(False, False, (), ())
    norm_types = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm)
    conv_types = (torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d)
    mods = list(model.modules())
    return ModelFacts(
        has_batchnorm=any(isinstance(m, norm_types) for m in mods),
        has_conv=any(isinstance(m, conv_types) for m in mods),
        blocks=tuple(checkpoint_candidates(model)),
        optimizer_impls=impls,
        output_vocab=None if head is None else head.out_features,
        optimizer_states=states,
        default_impl=default,
    )
