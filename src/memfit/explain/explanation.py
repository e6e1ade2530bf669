"""``explain()``: why a training step needs the memory it needs, and what to change — with the user's numbers.

Every number comes from the estimator: the fixes are the same workload re-estimated with one knob turned (same
code path as ``estimate``), so a fix's predicted peak is exactly what ``memfit estimate`` says for the changed
workload.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import ClassVar

from memfit.errors import MemfitError, UsageError
from memfit.estimate.allocator import AllocatorConfig
from memfit.estimate.categories import MemoryCategory
from memfit.estimate.gpus import GpuSpec, gpu_spec
from memfit.estimate.predict import Estimate, estimate
from memfit.estimate.trace import trace_workload
from memfit.explain.fixes import Fix, FixContext, combine_fixes, find_fixes
from memfit.explain.logits import logits_at_peak
from memfit.explain.oom_diagnosis import OomDiagnosis, diagnose_oom
from memfit.explain.oom_message import parse_oom_message
from memfit.records import JsonRecord
from memfit.units import format_bytes
from memfit.workload.knobs import activations_by_block, model_facts
from memfit.workload.spec import Workload

logger = logging.getLogger(__name__)

SCHEMA = 1


@dataclass(frozen=True)
class Part:
    """One category of the memory at the peak."""

    category: MemoryCategory
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
class Explanation(JsonRecord):
    """Why the step needs what it needs, and the fixes, ranked (largest saving first)."""

    _schema: ClassVar[int] = SCHEMA

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
    not_helping: list[Fix] = field(default_factory=list)
    """Fixes tried that do not lower the need (e.g. a smaller micro-batch when the peak is in the optimizer)."""
    oom: OomDiagnosis | None = None
    """The parsed CUDA OOM message and its diagnosis, when one was given."""
    notes: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    schema: int = SCHEMA


# ----------------------------------------------------------------------------------------------- explain()

_CATEGORY_WORDS: dict[MemoryCategory, str] = {
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
_SINGULAR: frozenset[MemoryCategory] = frozenset({"optimizer_state", "data", "fragmentation"})

_PEAK_OP_WORDS = {
    "cudnn_workspace": "a cuDNN workspace",
    # kernel_scratch.roi_align_compiled_backward_blocks: only under deterministic algorithms
    "_roi_align_backward_scratch": "the backward of torchvision's roi_align, which runs compiled under deterministic "
                                   "algorithms (its index sort and gradient blocks; without the setting it runs its "
                                   "kernel, which takes none)",
}
"""The trace's names for blocks that are not an op's output (``recorder``'s scratch and workspaces), in words."""


def _peak_op_words(op: str) -> str:
    """``op`` as the explanation says it: the scratch blocks a kernel takes inside an op are named by that op."""
    if op in _PEAK_OP_WORDS:
        return _PEAK_OP_WORDS[op]
    if op.endswith("_scratch"):
        return f"{op.removesuffix('_scratch')} (the kernel's scratch blocks)"
    return op


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
        >>> from memfit.workload.zoo import builtin_workload
        >>> e = explain(builtin_workload("mlp").replace(batch_size=8), fixes=False)
        >>> e.parts[0].category in ("params", "optimizer_state", "grads", "activations", "temporaries")
        True
    """
    started = time.perf_counter()
    if budget_bytes is not None and (isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int)
                                     or budget_bytes <= 0):
        raise UsageError(f"budget_bytes must be a positive number of bytes (an int), got {budget_bytes!r}. "
                         "For a size like '24GiB' use memfit.units.parse_bytes.")
    spec = gpu if isinstance(gpu, GpuSpec) else gpu_spec(gpu)
    config = allocator if allocator is not None else AllocatorConfig.from_env()
    trace = trace_workload(workload, spec)
    base = estimate(workload, gpu=spec, allocator=config, reuse_trace=trace)
    ctx = FixContext(workload, spec, config, base, budget_bytes)
    blocks = block_memory(base.activations_by_module)
    parts = _parts(base, blocks)
    scaling = _scaling(ctx)
    tried = find_fixes(ctx, trace) if fixes else []
    found = [f for f in tried if f.saving_bytes > 0]
    combination = combine_fixes(ctx, found) if fixes and budget_bytes is not None else None
    oom = diagnose_oom(parse_oom_message(oom_text), base) if oom_text is not None else None
    when, why = _peak_story(base, workload)
    notes = list(base.warnings)
    vocab = model_facts(workload).output_vocab
    logits = logits_at_peak(base, vocab)
    if logits is not None:
        notes.insert(0, logits.sentence(workload.loss_impl, chunkable=vocab is not None))
    if budget_bytes is not None and base.device_bytes > budget_bytes and fixes and combination is None and not any(
        f.fits_budget for f in found
    ):
        smallest = min([base, *ctx.cache.values()], key=lambda e: e.device_bytes)
        state = sum(base.breakdown.get(c, 0) for c in ("params", "grads", "optimizer_state"))
        notes.append(
            f"Nothing tried fits {format_bytes(budget_bytes)}: the smallest needs {format_bytes(smallest.device_bytes)}; "
            f"weights, gradients and optimizer state alone take {format_bytes(state)} plus the CUDA context "
            f"({format_bytes(base.device_bytes - base.fits_in_bytes)}). Shard them across GPUs (memfit.shard_model) or use a smaller "
            "model or a lower-memory optimizer."
        )
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
        fits_budget=None if budget_bytes is None else base.fits(budget_bytes),
        combination=combination,
        not_helping=[f for f in tried if f.saving_bytes <= 0],
        oom=oom,
        notes=notes,
        elapsed_s=time.perf_counter() - started,
    )


def block_memory(by_module: dict[str, int]) -> list[BlockMemory]:
    return [BlockMemory(n, b) for n, b in activations_by_block(by_module).items()]


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
        verdict = "fits" if est.fits(budget_bytes) else "does not fit"
        need += f" and {verdict} in {format_bytes(budget_bytes)}"
    if top is None:
        return need + "."
    words = _CATEGORY_WORDS.get(top.category, top.category)
    verb = "makes" if top.category in _SINGULAR else "make"
    cause = f"{words} {verb} up {top.share:.0%} of it"
    if top.category == "activations" and blocks:
        cause += f" ({blocks[0].name} alone holds {format_bytes(blocks[0].nbytes)})"
    return f"{need}; {cause}."


def _peak_story(est: Estimate, workload: Workload) -> tuple[str, str]:
    step = est.peak_step + 1
    where = _peak_op_words(est.peak_op) + (f" in {est.peak_module}" if est.peak_module else "")
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
        later = max((p.allocated_bytes for p in est.timeline if p.phase == "optimizer" and p.step > est.peak_step),
                    default=0)
        every_step = est.peak_step == 0 and later >= 0.99 * est.peak_allocated_bytes
        when = f"in the optimizer step of step {step}" + (
            ", from the first iteration on (every later step reaches it again)" if every_step
            else " (the first iteration)" if est.peak_step == 0 else "")
        why = (
            f"gradients ({format_bytes(b.get('grads', 0))}) and optimizer state "
            f"({format_bytes(b.get('optimizer_state', 0))}) are alive together with the update's temporaries "
            f"({format_bytes(b.get('temporaries', 0))})"
        )
        if est.peak_step == 0 and not every_step:
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


def _scaling(ctx: FixContext) -> Scaling | None:
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


def _per_element(nbytes: float) -> str:
    return f"{nbytes:.0f} bytes" if nbytes < 1024 else format_bytes(int(nbytes))


def _scaling_text(s: Scaling | None, est: Estimate, workload: Workload) -> str:
    if s is None:
        return ""
    size = "×".join(str(d) for d in (s.input_shape[1:] if s.input_unit in ("voxel", "pixel") else s.input_shape))
    text = (
        f"Each sample of the micro-batch adds {format_bytes(s.per_sample_bytes)}"
        + (f" ({_per_element(s.bytes_per_element)} per {s.input_unit} of its {size} input)" if size else "")
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
