"""``explain()``: why a training step needs the memory it needs, and what to change — with the user's numbers.

Every number comes from the estimator: the fixes are the same workload re-estimated with one knob turned (same
code path as ``estimate``), so a fix's predicted peak is exactly what ``memfit estimate`` says for the changed
workload.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from memfit.allocator import AllocatorConfig
from memfit.errors import MemfitError
from memfit.estimate import Estimate, estimate
from memfit.gpus import GpuSpec, gpu_spec
from memfit.units import format_bytes
from memfit.workload import Workload

logger = logging.getLogger(__name__)

SCHEMA = 1


@dataclass(frozen=True)
class Part:
    """One category of the memory at the peak."""

    category: str
    """params, buffers, grads, optimizer_state, activations, temporaries, workspaces, data, fragmentation."""
    nbytes: int
    share: float
    """Of ``fits_in_bytes`` (the memory the step needs)."""
    detail: str = ""
    """What inside it, in the user's words (e.g. the blocks holding most activations)."""


@dataclass(frozen=True)
class BlockMemory:
    """Activation bytes held for backward by one block (or a module outside any block) at the end of forward."""

    name: str
    nbytes: int


@dataclass(frozen=True)
class Scaling:
    """How the needed memory grows: ``fits_in ≈ fixed + per_sample × micro-batch``, from two estimates."""

    fixed_bytes: int
    """Needed at zero samples: weights, gradients, optimizer state, workspaces (extrapolated)."""
    per_sample_bytes: int
    batch_sizes: tuple[int, int]
    """The two micro-batch sizes estimated."""
    input_unit: str
    """``voxel``, ``pixel``, ``token`` or ``element``: what one input position is."""
    input_shape: tuple[int, ...]
    """One sample's main input, without the batch axis."""
    elements_per_sample: int
    """Input positions per sample (voxels, pixels, tokens)."""
    bytes_per_element: float
    """``per_sample_bytes / elements_per_sample``: what one more voxel/pixel/token of input costs."""


@dataclass(frozen=True)
class Fix:
    """One change to the step, re-estimated."""

    name: str
    """Short, imperative: ``micro-batch 2 × 4 accumulation``."""
    knob: str
    """micro_batch, precision, checkpointing, channels_last, optimizer, expandable_segments, patch, combined."""
    changes: dict[str, Any]
    """The Workload fields changed (``Workload.replace(**changes)`` reproduces it)."""
    allocator: str | None
    """The ``PYTORCH_CUDA_ALLOC_CONF`` it needs, if any."""
    peak_allocated_bytes: int
    fits_in_bytes: int
    device_bytes: int
    saving_bytes: int
    """Base ``fits_in_bytes`` minus this one's: positive saves memory."""
    time_factor: float | None
    """Predicted step time relative to the current step (1.25 = 25 % slower); None where no model says."""
    speed_cost: str
    """What it costs in speed, in words."""
    changes_training: str
    """``no`` (same mathematics), ``numerics`` (same algorithm, other rounding) or ``semantics`` (e.g. BatchNorm
    statistics over smaller batches, less context per patch)."""
    caveat: str = ""
    fits_budget: bool | None = None


@dataclass(frozen=True)
class Explanation:
    """Why the step needs what it needs, and the fixes, ranked (largest saving first)."""

    workload: str
    gpu: str
    estimate: Estimate
    headline: str
    """One sentence: how much, and the dominant cause."""
    parts: list[Part]
    blocks: list[BlockMemory]
    """Activation bytes per block, largest first."""
    peak_when: str
    peak_why: str
    scaling: Scaling | None
    scaling_text: str
    fixes: list[Fix]
    budget_bytes: int | None = None
    fits_budget: bool | None = None
    combination: Fix | None = None
    """With a budget the step does not fit: the cheapest set of fixes that makes it fit, re-estimated together."""
    oom: dict[str, Any] | None = None
    """The parsed CUDA OOM message and its diagnosis, when one was given."""
    notes: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    schema: int = SCHEMA

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["schema"] = SCHEMA
        return d

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)


# ----------------------------------------------------------------------------------------------- explain()

_CATEGORY_WORDS = {
    "params": "parameters",
    "buffers": "buffers",
    "grads": "gradients",
    "optimizer_state": "optimizer state",
    "data": "the batch",
    "activations": "activations",
    "temporaries": "temporaries",
    "workspaces": "library workspaces",
    "fragmentation": "fragmentation",
}
_INDEX = re.compile(r"^\d+$")


def explain(
    workload: Workload,
    *,
    gpu: str | GpuSpec | None = None,
    budget_bytes: int | None = None,
    allocator: AllocatorConfig | None = None,
    oom_text: str | None = None,
    fixes: bool = True,
) -> Explanation:
    """Explain the peak memory of ``workload``'s training step and rank the fixes, each re-estimated.

    Args:
        workload: the training step.
        gpu: the GPU to predict for (default H100).
        budget_bytes: the memory the GPU has for this process (compared with ``device_bytes``); with it, the
            fixes say whether they fit, and a combination of fixes is searched if none fits alone.
        allocator: caching-allocator settings (default: ``PYTORCH_CUDA_ALLOC_CONF`` from the environment).
        oom_text: a CUDA out-of-memory message (or a log holding one) to parse and tie to the estimate.
        fixes: re-estimate the fixes (each costs about one estimate); False gives the diagnosis only.

    Example:
        >>> from memfit.zoo import builtin_workload
        >>> e = explain(builtin_workload("mlp").replace(batch_size=8), fixes=False)
        >>> e.parts[0].category in ("params", "optimizer_state", "grads", "activations", "temporaries")
        True
    """
    from memfit.trace import trace_workload

    started = time.perf_counter()
    spec = gpu if isinstance(gpu, GpuSpec) else gpu_spec(gpu)
    config = allocator if allocator is not None else AllocatorConfig.from_env()
    trace = trace_workload(workload, spec)
    base = estimate(workload, gpu=spec, allocator=config, reuse_trace=trace)
    ctx = _Context(workload, spec, config, base, budget_bytes)
    blocks = _blocks(base.activations_by_module)
    parts = _parts(base, blocks)
    scaling = _scaling(ctx)
    found = _fixes(ctx, trace) if fixes else []
    combination = _combination(ctx, found) if fixes and budget_bytes is not None else None
    oom = None
    if oom_text is not None:
        from memfit.oom_message import diagnose_oom, parse_oom_message

        oom = diagnose_oom(parse_oom_message(oom_text), base).to_dict()
    when, why = _peak_story(base, workload)
    return Explanation(
        workload=workload.name,
        gpu=spec.name,
        estimate=base,
        headline=_headline(base, parts, blocks, budget_bytes),
        parts=parts,
        blocks=blocks,
        peak_when=when,
        peak_why=why,
        scaling=scaling,
        scaling_text=_scaling_text(scaling, base, workload),
        fixes=found,
        budget_bytes=budget_bytes,
        fits_budget=None if budget_bytes is None else base.device_bytes <= budget_bytes,
        combination=combination,
        oom=oom,
        notes=list(base.warnings),
        elapsed_s=time.perf_counter() - started,
    )


@dataclass
class _Context:
    workload: Workload
    gpu: GpuSpec
    allocator: AllocatorConfig
    base: Estimate
    budget_bytes: int | None
    cache: dict[str, Estimate] = field(default_factory=dict)

    def estimate(self, changes: dict[str, Any], allocator: AllocatorConfig | None = None) -> Estimate:
        """The estimate of the workload with ``changes``: the same call ``memfit estimate`` makes."""
        key = json.dumps([changes, allocator is not None and asdict(allocator)], sort_keys=True, default=str)
        if key not in self.cache:
            self.cache[key] = estimate(
                self.workload.replace(**changes), gpu=self.gpu, allocator=allocator or self.allocator
            )
        return self.cache[key]


def _block_of(name: str) -> str:
    """The block a module belongs to: its name up to the first list index (``decoder.2.0.conv`` -> ``decoder.2``)."""
    parts = name.split(".")
    for i, p in enumerate(parts):
        if _INDEX.match(p):
            return ".".join(parts[: i + 1])
    return parts[0] if parts else name


def _blocks(by_module: dict[str, int]) -> list[BlockMemory]:
    out: dict[str, int] = {}
    for name, nbytes in by_module.items():
        key = name if name.startswith("(") else _block_of(name)
        out[key] = out.get(key, 0) + nbytes
    return [BlockMemory(n, b) for n, b in sorted(out.items(), key=lambda kv: -kv[1])]


def _parts(est: Estimate, blocks: list[BlockMemory]) -> list[Part]:
    total = max(est.fits_in_bytes, 1)
    details = {
        "activations": ", ".join(f"{b.name} holds {format_bytes(b.nbytes)}" for b in blocks[:3]),
        "optimizer_state": "created at the first optimizer step and kept for the whole run",
        "fragmentation": "cached blocks the allocator cannot reuse for the next request",
        "temporaries": f"peak op {est.peak_op}" + (f" in {est.peak_module}" if est.peak_module else ""),
    }
    parts = [
        Part(cat, nbytes, nbytes / total, details.get(cat, ""))
        for cat, nbytes in est.breakdown.items()
        if nbytes > 0
    ]
    return sorted(parts, key=lambda p: -p.nbytes)


def _headline(est: Estimate, parts: list[Part], blocks: list[BlockMemory], budget_bytes: int | None) -> str:
    top = parts[0] if parts else None
    need = f"This step needs {format_bytes(est.device_bytes)} of GPU memory"
    if budget_bytes is not None:
        verdict = "fits" if est.device_bytes <= budget_bytes else "does not fit"
        need += f" and {verdict} in {format_bytes(budget_bytes)}"
    if top is None:
        return need + "."
    cause = f"{_CATEGORY_WORDS.get(top.category, top.category)} are {top.share:.0%} of it"
    if top.category == "activations" and blocks:
        cause += f" ({blocks[0].name} alone holds {format_bytes(blocks[0].nbytes)})"
    return f"{need}; {cause}."


def _peak_story(est: Estimate, workload: Workload) -> tuple[str, str]:
    step = est.peak_step + 1
    where = f"{est.peak_op}" + (f" in {est.peak_module}" if est.peak_module else "")
    b = est.breakdown
    if est.peak_phase in ("forward", "loss"):
        when = f"at the end of the forward pass of step {step} ({where})"
        why = (
            f"every activation saved for backward is alive at once ({format_bytes(b.get('activations', 0))}), "
            "on top of the weights and optimizer state"
        )
    elif est.peak_phase == "backward":
        when = f"during the backward pass of step {step}, in {where}"
        why = (
            f"activations not yet consumed by backward ({format_bytes(b.get('activations', 0))}) meet the "
            f"gradients produced so far ({format_bytes(b.get('grads', 0))}) and the kernel's temporaries "
            f"({format_bytes(b.get('temporaries', 0) + b.get('workspaces', 0))})"
        )
    elif est.peak_phase == "optimizer":
        when = f"in the optimizer step of step {step}" + (" (the first iteration)" if est.peak_step == 0 else "")
        why = (
            f"gradients ({format_bytes(b.get('grads', 0))}) and optimizer state "
            f"({format_bytes(b.get('optimizer_state', 0))}) are alive together with the update's temporaries "
            f"({format_bytes(b.get('temporaries', 0))})"
        )
        if est.peak_step == 0:
            why += "; the optimizer creates its state lazily at the first step, while the first step's "
            why += "gradients are still alive"
        if workload.optimizer_impl in ("default", "foreach") and b.get("temporaries", 0) > 0:
            why += "; the foreach update allocates temporaries about the size of the parameters"
    else:
        when, why = f"in {est.peak_phase} of step {step} ({where})", ""
    return when, why


def _input_geometry(workload: Workload) -> tuple[str, tuple[int, ...], int]:
    """(unit, one sample's shape, positions per sample) of the batch's first tensor, built on the meta device."""
    import torch

    try:
        with torch.device("meta"):
            batch = workload.make_batch(1)
    except Exception:  # the user's factory may not build on meta; then we only say "element"
        return "element", (), 1
    first = batch
    while isinstance(first, (list, tuple)) and first:
        first = first[0]
    if isinstance(first, dict) and first:
        first = next(iter(first.values()))
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        return "element", (), 1
    shape = tuple(first.shape[1:])
    if first.is_floating_point() and first.dim() in (4, 5):
        spatial = shape[1:]
        return ("voxel" if len(spatial) == 3 else "pixel"), shape, math.prod(spatial)
    if not first.is_floating_point() and first.dim() == 2:
        return "token", shape, shape[0]
    return "element", shape, max(1, math.prod(shape))


def _scaling(ctx: _Context) -> Scaling | None:
    b = ctx.workload.batch_size
    other = 2 if b == 1 else b // 2
    try:
        est_other = ctx.estimate({"batch_size": other})
    except MemfitError:
        return None
    per_sample = (ctx.base.peak_allocated_bytes - est_other.peak_allocated_bytes) // (b - other)
    fixed = ctx.base.fits_in_bytes - per_sample * b
    unit, shape, elements = _input_geometry(ctx.workload)
    return Scaling(
        fixed_bytes=fixed,
        per_sample_bytes=per_sample,
        batch_sizes=(min(b, other), max(b, other)),
        input_unit=unit,
        input_shape=shape,
        elements_per_sample=elements,
        bytes_per_element=per_sample / elements,
    )


def _scaling_text(s: Scaling | None, est: Estimate, workload: Workload) -> str:
    if s is None:
        return ""
    size = "×".join(str(d) for d in (s.input_shape[1:] if s.input_unit in ("voxel", "pixel") else s.input_shape))
    text = (
        f"Each sample of the micro-batch adds {format_bytes(s.per_sample_bytes)}"
        + (f" ({s.bytes_per_element:.0f} bytes per {s.input_unit} of its {size} input)" if size else "")
        + f"; {format_bytes(max(s.fixed_bytes, 0))} does not depend on the batch (weights, gradients, optimizer "
        "state, workspaces)."
    )
    at_one = s.fixed_bytes + s.per_sample_bytes
    if workload.batch_size == 1 or at_one > 0.5 * est.fits_in_bytes:
        text += (
            f" Even at batch size 1 it needs about {format_bytes(at_one)}: the size of one input and the depth "
            "and width of the network set that, not the batch."
        )
    return text


# -------------------------------------------------------------------------------------------------- fixes

_COST_ORDER = {"no": 0, "numerics": 1, "semantics": 2}


@dataclass(frozen=True)
class _ModelFacts:
    has_batchnorm: bool
    has_conv: bool
    blocks: tuple[str, ...]
    optimizer_impls: tuple[str, ...]


def _model_facts(workload: Workload) -> _ModelFacts:
    """What the fixes need to know about the model, from building it on the meta device (no memory)."""
    import torch

    from memfit.knobs import checkpoint_candidates, optimizer_impls_for

    try:
        with torch.device("meta"):
            model = workload.model()
            impls = tuple(optimizer_impls_for(workload.optimizer(model.parameters())))
    except Exception:  # a factory that cannot build on meta: offer only the fixes that need no model facts
        return _ModelFacts(False, False, (), ())
    norm_types = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm)
    conv_types = (torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d)
    mods = list(model.modules())
    return _ModelFacts(
        has_batchnorm=any(isinstance(m, norm_types) for m in mods),
        has_conv=any(isinstance(m, conv_types) for m in mods),
        blocks=tuple(checkpoint_candidates(model)),
        optimizer_impls=impls,
    )


def _make_fix(ctx: _Context, est: Estimate, **fields: Any) -> Fix:
    budget = ctx.budget_bytes
    return Fix(
        peak_allocated_bytes=est.peak_allocated_bytes,
        fits_in_bytes=est.fits_in_bytes,
        device_bytes=est.device_bytes,
        saving_bytes=ctx.base.fits_in_bytes - est.fits_in_bytes,
        time_factor=_time_factor(ctx.base, est, ctx),
        fits_budget=None if budget is None else est.device_bytes <= budget,
        **fields,
    )


def _time_factor(base: Estimate, est: Estimate, ctx: _Context) -> float | None:
    """Predicted step time of ``est``'s workload over the current one's, from the roofline speed model."""
    if getattr(base, "cost", None) is None or getattr(est, "cost", None) is None:
        return None
    from memfit.speed import predict_step_time

    t0 = predict_step_time(base.cost, ctx.gpu, accumulation=ctx.workload.accumulation_steps).step_time_s
    acc = est.config.get("accumulation_steps", 1) if hasattr(est, "config") else 1
    t1 = predict_step_time(est.cost, ctx.gpu, accumulation=acc).step_time_s
    return t1 / t0 if t0 > 0 else None


def _fixes(ctx: _Context, trace: Any) -> list[Fix]:
    w, base = ctx.workload, ctx.base
    facts = _model_facts(w)
    fixes: list[Fix] = []

    def attempt(changes: dict[str, Any], **fields: Any) -> Fix | None:
        try:
            est = ctx.estimate(changes)
        except MemfitError as exc:  # a knob the model cannot take (e.g. fused for this optimizer): skip it
            logger.info("fix %s skipped: %s", fields.get("name"), exc)
            return None
        fix = _make_fix(ctx, est, changes=changes, allocator=None, **fields)
        fixes.append(fix)
        return fix

    # 1. smaller micro-batch, same effective batch; with a budget, keep halving until it fits
    micro = w.batch_size
    while micro > 1:
        micro = max(d for d in range(1, micro) if w.batch_size % d == 0 and d <= micro // 2) if micro > 1 else 1
        acc = w.accumulation_steps * (w.batch_size // micro)
        fix = attempt(
            {"batch_size": micro, "accumulation_steps": acc},
            name=f"micro-batch {micro} × {acc} accumulation (effective batch {w.effective_batch_size})",
            knob="micro_batch",
            speed_cost="smaller kernels use the GPU less well and launch overhead repeats per micro-batch",
            changes_training="semantics" if facts.has_batchnorm else "no",
            caveat=f"BatchNorm statistics come from {micro} samples instead of {w.batch_size}"
            if facts.has_batchnorm else "the loss is averaged over the effective batch, as before",
        )
        if fix is None or ctx.budget_bytes is None or fix.fits_budget:
            break
    # 2. mixed precision
    if w.precision == "fp32":
        attempt(
            {"precision": "bf16"},
            name="bf16 autocast",
            knob="precision",
            speed_cost="usually faster: matmuls and convolutions run on tensor cores",
            changes_training="numerics",
            caveat="bf16 needs compute capability 8.0+ (A100, H100, RTX 30xx+); use fp16 + GradScaler before that",
        )
    # 3. activation checkpointing of the blocks that hold the most
    if facts.blocks and not w.checkpoint:
        _checkpoint_fixes(ctx, facts, attempt)
    # 4. channels_last for convolutional nets
    if facts.has_conv and not w.channels_last:
        attempt(
            {"channels_last": True},
            name="channels_last memory format",
            knob="channels_last",
            speed_cost="often faster for convolutions under autocast (cuDNN's NHWC kernels); measure for fp32",
            changes_training="no",
        )
    # 5. optimizer implementation: same mathematics, other temporaries
    if w.optimizer_impl in ("default", "foreach"):
        for impl, speed in (("fused", "faster: one kernel per parameter group"),
                            ("for-loop", "slower: several kernels per parameter")):
            if impl in facts.optimizer_impls:
                attempt(
                    {"optimizer_impl": impl},
                    name=f"{impl} optimizer",
                    knob="optimizer",
                    speed_cost=speed,
                    changes_training="no",
                    caveat="the same update up to floating-point rounding",
                )
    # 6. expandable segments: the same allocations, placed without fragmentation
    if not ctx.allocator.expandable_segments:
        expandable = dataclasses.replace(ctx.allocator, expandable_segments=True)
        est = estimate(w, gpu=ctx.gpu, allocator=expandable, reuse_trace=trace)
        fixes.append(_make_fix(
            ctx, est, changes={}, allocator="expandable_segments:True",
            name="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
            knob="expandable_segments",
            speed_cost="about none",
            changes_training="no",
            caveat="set it before CUDA starts; avoid with CUDA graphs + NCCL buffer registration",
        ))
    # 7. a smaller patch, where the workload says how to make one
    if w.patch_size is not None:
        smaller = _smaller_patch(w.patch_size, w.patch_multiple)
        if smaller is not None:
            attempt(
                {"patch_size": smaller},
                name=f"patch {'×'.join(map(str, smaller))} instead of {'×'.join(map(str, w.patch_size))}",
                knob="patch",
                speed_cost="more steps per epoch for the same data",
                changes_training="semantics",
                caveat="each sample sees less context; segmentation quality can change",
            )
    fixes = [f for f in fixes if f.saving_bytes > 0]
    return sorted(fixes, key=lambda f: -f.saving_bytes)


def _checkpoint_fixes(ctx: _Context, facts: _ModelFacts, attempt: Any) -> None:
    held = {b.name: b.nbytes for b in _blocks(ctx.base.activations_by_module)}
    ranked = sorted((b for b in facts.blocks if held.get(b, 0) > 0), key=lambda b: -held[b])
    if not ranked:
        return
    total = sum(held[b] for b in ranked)
    # the fewest blocks that hold half of the blocks' activations, then all of them
    top, acc = [], 0
    for b in ranked:
        top.append(b)
        acc += held[b]
        if acc >= total / 2:
            break
    choices = [top] if len(top) < len(ranked) else []
    choices.append(ranked)
    for chosen in choices:
        order = [b for b in facts.blocks if b in chosen]  # forward order reads better
        label = f"all {len(order)} blocks" if len(order) == len(ranked) else _list_names(order)
        attempt(
            {"checkpoint": tuple(order)},
            name=f"activation checkpointing of {label}",
            knob="checkpointing",
            speed_cost="about one more forward of the checkpointed blocks (+20-35 % step time when all are)",
            changes_training="no",
            caveat="BatchNorm inside a checkpointed block updates its running statistics twice"
            if facts.has_batchnorm else "",
        )


def _list_names(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _smaller_patch(patch: tuple[int, ...], multiple: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """About half the volume: each axis scaled by 2^(-1/ndim), rounded down to its divisibility step."""
    steps = multiple or (1,) * len(patch)
    scale = 0.5 ** (1 / len(patch))
    out = tuple(max(m, int(p * scale) // m * m) for p, m in zip(patch, steps))
    return out if out != patch else None


def _combination(ctx: _Context, fixes: list[Fix]) -> Fix | None:
    """The cheapest set of fixes that fits the budget: free ones first, then by cost, re-estimated together."""
    assert ctx.budget_bytes is not None
    if ctx.base.device_bytes <= ctx.budget_bytes:
        return None
    singles = [f for f in fixes if f.fits_budget]
    if singles:
        return None  # one fix alone is enough; the table says which
    pick: dict[str, Fix] = {}
    for f in fixes:  # one choice per knob: the largest saving of that knob
        if f.knob not in pick or f.saving_bytes > pick[f.knob].saving_bytes:
            pick[f.knob] = f
    ordered = sorted(pick.values(), key=lambda f: (_COST_ORDER[f.changes_training], f.time_factor or 1.0))
    changes: dict[str, Any] = {}
    allocator: AllocatorConfig | None = None
    names: list[str] = []
    for f in ordered:
        changes.update(f.changes)
        if f.allocator:
            allocator = dataclasses.replace(ctx.allocator, expandable_segments=True)
        names.append(f.name)
        try:
            est = ctx.estimate(dict(changes), allocator)
        except MemfitError:
            continue
        if est.device_bytes <= ctx.budget_bytes:
            worst = max((x.changes_training for x in ordered[: len(names)]), key=_COST_ORDER.__getitem__)
            return _make_fix(
                ctx, est, name=" + ".join(names), knob="combined", changes=dict(changes),
                allocator="expandable_segments:True" if allocator else None,
                speed_cost="the sum of its parts", changes_training=worst,
            )
    return None
