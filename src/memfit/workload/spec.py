"""How a user describes one training step: the ``Workload``.

A workload is a recipe, not a set of tensors: factories for the model, the batch and the optimizer, so memfit can
build the step on fake tensors (``estimate``), on a real GPU (``measure``), or at another batch size or precision
(``explain``, ``plan``) without the user writing it twice.

Example (a file ``my_step.py`` that ``memfit estimate my_step.py`` loads)::

    import torch, memfit
    workload = memfit.Workload(
        model=lambda: torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)),
        batch=lambda n: (torch.randn(n, 512), torch.randint(0, 10, (n,))),
        loss=lambda out, batch: torch.nn.functional.cross_entropy(out, batch[1]),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        batch_size=64,
        precision="bf16",
    )
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

from memfit.errors import WorkloadError

if TYPE_CHECKING:
    import torch

Precision = Literal["fp32", "bf16", "fp16"]
"""How a step computes: fp32, or forward and loss under bf16 / fp16 autocast (fp16 adds a GradScaler)."""
PRECISIONS: tuple[Precision, ...] = get_args(Precision)
OptimizerImpl = Literal["default", "foreach", "for-loop", "fused"]
"""How ``optimizer.step()`` runs: what the factory asked for, or one of PyTorch's three implementations."""
OPTIMIZER_IMPLS: tuple[OptimizerImpl, ...] = get_args(OptimizerImpl)
LossImpl = Literal["default", "chunked"]
"""How a causal LM's output layer and cross-entropy run: as the model writes them, or over chunks of tokens
(``memfit.workload.chunked_cross_entropy``) without the (tokens × vocabulary) logits."""
LOSS_IMPLS: tuple[LossImpl, ...] = get_args(LossImpl)
CheckpointMode = Literal["full", "selective", "reentrant"]
"""How the blocks of ``Workload.checkpoint`` are checkpointed (see that field)."""
CHECKPOINT_MODES: tuple[CheckpointMode, ...] = get_args(CheckpointMode)
OptimizerState = Literal["full", "8bit", "cpu_offload"]
"""Where and how Adam/AdamW keeps its two moment estimates: ``full`` (the parameters' dtype, on the GPU), ``8bit``
(torchao's block-quantized 8-bit states) or ``cpu_offload`` (torchao's ``CPUOffloadOptimizer``: states and the
update on the CPU). See ``memfit.workload.optimizer_state``."""
OPTIMIZER_STATES: tuple[OptimizerState, ...] = get_args(OptimizerState)


def default_forward(model: Any, batch: Any) -> Any:
    """``model(batch[0])`` for a tuple/list batch, ``model(**batch)`` for a dict, ``model(batch)`` for a tensor.

    What a ``Workload`` without ``forward`` and a ``TrainStep`` without ``forward_fn`` call.
    """
    if isinstance(batch, (tuple, list)):
        return model(batch[0])
    if isinstance(batch, dict):
        return model(**batch)
    return model(batch)


MAX_BATCH_SIZE = 2**31 - 1
"""The largest batch size (and accumulation count, and patch extent) a workload takes: more is a typo, and tensor
sizes past it overflow the 64-bit element counts of the larger layers."""


def _is_int(value: Any) -> bool:
    """An integer, including NumPy's (``np.int64(4)``), but not a bool or a float."""
    return not _is_bool(value) and hasattr(type(value), "__index__")


def _is_bool(value: Any) -> bool:
    # NumPy's bool (numpy.bool_, named numpy.bool in NumPy 2), without importing NumPy
    return isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool"))


def _count(name: str, value: Any) -> int:
    if not _is_int(value):
        raise WorkloadError(f"{name} must be a positive integer, got {value!r}.")
    n = operator.index(value)
    if n < 1:
        raise WorkloadError(f"{name} must be a positive integer, got {value!r}.")
    if n > MAX_BATCH_SIZE:
        shown = repr(n) if len(repr(n)) <= 30 else f"{repr(n)[:27]}..."
        raise WorkloadError(f"{name} must be at most {MAX_BATCH_SIZE}, got {shown}: a batch that large is a typo.")
    return n


@dataclass(frozen=True, kw_only=True)
class Workload:
    """One training step, described by factories.

    Tensors made by ``model`` and ``batch`` must not name a device: memfit creates them on the device it simulates
    or measures (fake tensors for an estimate, the GPU for a measurement).
    """

    model: Callable[[], torch.nn.Module]
    """Builds the model with fresh (random) weights. Called inside memfit's device context."""
    batch: Callable[..., Any]
    """Takes the batch size (and ``patch_size`` when that is set), returns the batch: a tensor, a tuple/list or a
    dict of tensors."""
    loss: Callable[[Any, Any], torch.Tensor]
    """``loss(output, batch) -> scalar tensor``."""
    optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
    """Takes the parameters, returns the optimizer. Leave ``foreach``/``fused`` unset to get PyTorch's CUDA default."""
    batch_size: int
    """Samples per forward/backward (the micro-batch). Activation memory grows about linearly with it."""
    precision: Precision = "fp32"
    """``fp32``; ``bf16`` autocast; or ``fp16`` autocast with a GradScaler. Autocast halves most activations."""
    forward: Callable[[Any, Any], Any] | None = None
    """``forward(model, batch) -> output``; default ``model(batch[0])`` (``model(**batch)`` for a dict batch)."""
    keep_output: bool = True
    """The loop keeps the model's output alive through backward and the optimizer step, as the plain loop
    ``out = model(x); loss = crit(out, y); loss.backward(); opt.step()`` does (``out`` is freed only when the next
    forward rebinds it). ``False``: the output is dropped before backward, as in Lightning's ``training_step``,
    Hugging Face Trainer's ``compute_loss`` and memfit's ``TrainStep``. Costs the output's size (the logits of a
    language model: batch × sequence × vocabulary) on top of the backward peak."""
    channels_last: bool = False
    """Convert the model (and 4-D/5-D inputs) to channels_last memory format, as cuDNN prefers for AMP convs."""
    accumulation_steps: int = 1
    """Micro-batches of ``batch_size`` per optimizer step (gradient accumulation): the effective batch is
    ``batch_size * accumulation_steps``. Costs one more forward/backward launch sequence per micro-batch; from the
    second micro-batch on, the gradients are alive during forward."""
    checkpoint: tuple[str, ...] = ()
    """Qualified names of blocks (e.g. ``"layers.3"``) run under activation checkpointing: only their inputs are
    kept for backward, at the cost of about one more forward of those blocks."""
    checkpoint_mode: CheckpointMode = "full"
    """How the ``checkpoint`` blocks run. ``full``: non-reentrant ``torch.utils.checkpoint``; the block keeps its
    inputs and runs its whole forward again in backward. ``selective``: the same, under an op-level policy
    (``memfit.workload.selective_checkpoint``) that also keeps the outputs of matmuls, convolutions and fused
    attention; more memory than ``full`` (those outputs), less recompute (only pointwise ops, norms, activations).
    ``reentrant``: ``use_reentrant=True``; the memory of ``full``, the recompute and backward of the block run as
    one inner backward (fewer Python hooks). Keyword tensors of a block must not need gradients, and a block whose
    inputs need none gets a zero-size input that does, so its parameters still get gradients."""
    optimizer_impl: OptimizerImpl = "default"
    """``default`` (what the factory asked for; PyTorch picks foreach on CUDA), ``foreach``, ``for-loop`` or
    ``fused``: the same mathematics, different temporaries and speed."""
    optimizer_state: OptimizerState = "full"
    """``8bit``: Adam/AdamW run as torchao's ``AdamW8bit``/``Adam8bit`` (same hyper-parameters), whose moments take
    1 byte per element plus a 4-byte scale per 256 instead of 8 bytes (fp32): about a quarter of the optimizer
    state, with slightly different numerics and a compiled per-parameter update. ``cpu_offload``: torchao's
    ``CPUOffloadOptimizer`` keeps the states and runs the update on the CPU; the GPU keeps only the states of
    parameters under 4096 elements, and each step copies the gradients to the host and the parameters back (much
    slower unless the step is long). Both need torchao (``pip install torchao``) to run; estimating needs nothing.
    Refused for optimizers other than ``torch.optim.Adam``/``AdamW``."""
    loss_impl: LossImpl = "default"
    """``chunked``: the model's output Linear and cross-entropy run over chunks of tokens, so the batch × sequence
    × vocabulary logits (and their fp32 copy and gradient) never exist at once; the same loss up to rounding, at
    the cost of one more output-layer matmul. Needs a Hugging Face-shaped causal LM called with ``labels``
    (``memfit.workload.chunked_cross_entropy.use_chunked_cross_entropy``)."""
    patch_size: tuple[int, ...] | None = None
    """Spatial size of one input sample (``(128, 128, 128)``). When set, ``batch`` is called as
    ``batch(n, patch_size)``, which lets ``memfit plan --patch`` search it."""
    patch_multiple: tuple[int, ...] | None = None
    """What each patch axis must be divisible by (the network's total downsampling, e.g. ``(32, 32, 32)``)."""
    name: str = "workload"
    """A short name for reports."""
    description: str = ""
    """One line on what it is, for reports."""
    tags: tuple[str, ...] = field(default=())
    """Free-form labels (architecture family, input kind) used by reports and the planner."""

    def __post_init__(self) -> None:
        for attr in ("model", "batch", "loss", "optimizer"):
            if not callable(getattr(self, attr)):
                raise WorkloadError(
                    f"Workload.{attr} must be callable (a factory), got {type(getattr(self, attr)).__name__}. "
                    f"Write e.g. {attr}=lambda ...: ..."
                )
        if not isinstance(self.model, type) and hasattr(self.model, "parameters") and hasattr(self.model, "forward"):
            raise WorkloadError(
                "Workload.model must be a factory that builds the model, got a model instance. "
                f"Write model=lambda: {type(self.model).__name__}(...) so memfit can build it on its device."
            )
        if not isinstance(self.optimizer, type) and hasattr(self.optimizer, "param_groups"):
            raise WorkloadError(
                "Workload.optimizer must be a factory taking the parameters, got an optimizer instance. "
                "Write optimizer=lambda params: torch.optim.AdamW(params, lr=...)."
            )
        if not isinstance(self.keep_output, bool):
            raise WorkloadError(f"Workload.keep_output must be True or False, got {self.keep_output!r}.")
        if self.forward is not None and not callable(self.forward):
            raise WorkloadError("Workload.forward must be callable: forward(model, batch) -> output.")
        for attr in ("batch_size", "accumulation_steps"):
            object.__setattr__(self, attr, _count(f"Workload.{attr}", getattr(self, attr)))
        if not _is_bool(self.channels_last):
            raise WorkloadError(f"Workload.channels_last must be True or False, got {self.channels_last!r}.")
        object.__setattr__(self, "channels_last", bool(self.channels_last))
        if isinstance(self.checkpoint, (str, bytes)) or not isinstance(self.checkpoint, Iterable) or not all(
            isinstance(n, str) for n in self.checkpoint
        ):
            raise WorkloadError(
                f"Workload.checkpoint must be a tuple of module names such as ('layers.0',), got {self.checkpoint!r}."
            )
        object.__setattr__(self, "checkpoint", tuple(self.checkpoint))
        if not isinstance(self.checkpoint_mode, str) or self.checkpoint_mode not in CHECKPOINT_MODES:
            raise WorkloadError(
                f"Workload.checkpoint_mode must be one of {', '.join(CHECKPOINT_MODES)}, got {self.checkpoint_mode!r}."
            )
        for attr in ("name", "description"):
            if not isinstance(getattr(self, attr), str):
                raise WorkloadError(f"Workload.{attr} must be a string, got {getattr(self, attr)!r}.")
        if not isinstance(self.optimizer_impl, str) or self.optimizer_impl not in OPTIMIZER_IMPLS:
            raise WorkloadError(
                f"Workload.optimizer_impl must be one of {', '.join(OPTIMIZER_IMPLS)}, got {self.optimizer_impl!r}."
            )
        if not isinstance(self.optimizer_state, str) or self.optimizer_state not in OPTIMIZER_STATES:
            raise WorkloadError(
                f"Workload.optimizer_state must be one of {', '.join(OPTIMIZER_STATES)}, got {self.optimizer_state!r}."
            )
        if self.optimizer_state != "full" and self.optimizer_impl != "default":
            raise WorkloadError(
                f"Workload.optimizer_state={self.optimizer_state!r} brings its own implementation: leave "
                f"optimizer_impl at 'default' (got {self.optimizer_impl!r})."
            )
        if not isinstance(self.loss_impl, str) or self.loss_impl not in LOSS_IMPLS:
            raise WorkloadError(
                f"Workload.loss_impl must be one of {', '.join(LOSS_IMPLS)}, got {self.loss_impl!r}."
            )
        for attr in ("patch_size", "patch_multiple"):
            value = getattr(self, attr)
            if value is None:
                continue
            if isinstance(value, (str, bytes)) or not isinstance(value, Iterable) or not value or not all(
                _is_int(v) and 0 < v <= MAX_BATCH_SIZE for v in value
            ):
                raise WorkloadError(f"Workload.{attr} must be a tuple of positive integers, got {value!r}.")
            object.__setattr__(self, attr, tuple(int(v) for v in value))
        if self.patch_multiple is not None and self.patch_size is not None and (
            len(self.patch_multiple) != len(self.patch_size)
        ):
            raise WorkloadError(
                f"Workload.patch_multiple {self.patch_multiple} must have one entry per patch axis "
                f"{self.patch_size}."
            )
        if not isinstance(self.precision, str) or self.precision not in PRECISIONS:
            raise WorkloadError(
                f"Workload.precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}."
            )

    def replace(self, **changes: Any) -> Workload:
        """A copy with some fields changed, validated again: ``w.replace(batch_size=8, precision="bf16")``."""
        return dataclasses.replace(self, **changes)

    @property
    def effective_batch_size(self) -> int:
        """Samples per optimizer step: ``batch_size * accumulation_steps``."""
        return self.batch_size * self.accumulation_steps

    def make_batch(self, n: int) -> Any:
        """Call the batch factory for ``n`` samples (and the patch size, when the workload has one)."""
        return self.batch(n) if self.patch_size is None else self.batch(n, self.patch_size)

    def run_forward(self, model: Any, batch: Any) -> Any:
        return (self.forward or default_forward)(model, batch)
