"""Where Adam's moments live: full precision on the GPU, 8-bit on the GPU, or on the CPU (``Workload.optimizer_state``).

``set_optimizer_state`` rebuilds the user's ``torch.optim.Adam``/``AdamW`` as torchao's ``AdamW8bit``/``Adam8bit``
or ``CPUOffloadOptimizer`` with the same parameter groups and hyper-parameters, for ``measure``, ``TrainStep`` and
``Plan.apply``. The estimator does not run torchao (its 8-bit state constructor reads tensor values, which fake
tensors lack, and its update is ``torch.compile``'d): it builds stand-ins from the layout constants below
(``memfit.estimate.optimizer_twins``), and a test checks them against torchao's own buffers where it is installed.

Every constant is torchao 0.18.0's (``torchao/optim/adam.py``, ``subclass_8bit.py``, ``cpu_offload.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from memfit.errors import WorkloadError
from memfit.workload.spec import OPTIMIZER_STATES, OptimizerState

EIGHT_BIT_BLOCK = 256
"""Elements per quantization block: ``AdamW8bit(block_size=256)`` (torchao/optim/adam.py); each block has one
fp32 scale (``OptimState8bit.zeros``: ``torch.zeros(codes.numel() // block_size)``, subclass_8bit.py)."""
EIGHT_BIT_MIN_NUMEL = 4096
"""Smaller states stay in the parameter's dtype: ``_AdamBase._new_buffer`` quantizes only tensors with
``numel() >= 4096 and numel() % block_size == 0`` ("follow bitsandbytes", torchao/optim/adam.py)."""
EIGHT_BIT_QMAP = 256
"""fp32 entries of each quantized state's own code book (``OptimState8bit.zeros``: ``torch.tensor(qmap_list)``
of ``create_dynamic_map``'s 2**8 values, on the parameter's device)."""
OFFLOAD_MINIMAL_SIZE = 4096
"""``CPUOffloadOptimizer(minimal_size=4096)`` (torchao/optim/cpu_offload.py): parameters with fewer elements are
updated on the GPU by the same optimizer class (``fused=True`` for AdamW); the others have their states, a pinned
copy and a pinned gradient on the host."""

_HYPER = ("lr", "betas", "eps", "weight_decay", "amsgrad")
_INSTALL = "pip install torchao"


@dataclass(frozen=True)
class AdamSettings:
    """What the replacements take from the user's Adam/AdamW."""

    decoupled: bool
    """AdamW's weight decay (``AdamW``, or ``Adam(decoupled_weight_decay=True)``), else Adam's L2 penalty."""
    groups: list[dict[str, Any]]
    """The parameter groups: ``params`` and the hyper-parameters in ``_HYPER``, the learning rate as a float."""

    @property
    def torch_class(self) -> type[torch.optim.Optimizer]:
        return torch.optim.AdamW if self.decoupled else torch.optim.Adam


def adam_settings(optimizer: torch.optim.Optimizer) -> AdamSettings:
    """The hyper-parameters of a ``torch.optim.Adam``/``AdamW``; anything else is refused with one line."""
    cls = type(optimizer)
    if cls not in (torch.optim.Adam, torch.optim.AdamW):
        raise WorkloadError(
            f"optimizer_state '8bit'/'cpu_offload' replaces torch.optim.Adam or AdamW, got {cls.__module__}."
            f"{cls.__name__}: use optimizer_state='full' for it."
        )
    groups = []
    for group in optimizer.param_groups:
        for flag in ("maximize", "differentiable"):
            if group.get(flag):
                raise WorkloadError(f"{cls.__name__}({flag}=True) has no 8-bit or offloaded version in torchao: "
                                    "use optimizer_state='full'.")
        lr = group["lr"]
        groups.append({"params": list(group["params"]),
                       **{k: group[k] for k in _HYPER if k != "lr"},
                       "lr": float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)})
    decoupled = cls is torch.optim.AdamW or bool(optimizer.defaults.get("decoupled_weight_decay", False))
    return AdamSettings(decoupled=decoupled, groups=groups)


def set_optimizer_state(optimizer: torch.optim.Optimizer, state: str) -> torch.optim.Optimizer:
    """``optimizer`` rebuilt to keep its states as ``state`` says (``Workload.optimizer_state``).

    ``full`` returns it unchanged; ``8bit`` gives torchao's ``AdamW8bit`` (or ``Adam8bit``), ``cpu_offload``
    torchao's ``CPUOffloadOptimizer`` around ``torch.optim.AdamW`` (or ``Adam``), with the same groups, learning
    rates, betas, eps, weight decay and amsgrad. The offloaded one needs CUDA.

    Raises:
        WorkloadError: the optimizer is not Adam/AdamW, torchao is missing, or (offload) there is no CUDA.
    """
    if state == "full":
        return optimizer
    if state not in OPTIMIZER_STATES:
        raise WorkloadError(f"optimizer state must be one of {', '.join(OPTIMIZER_STATES)}, got {state!r}.")
    settings = adam_settings(optimizer)
    try:
        import torchao.optim as ao  # lazily: optional, and heavy
    except ImportError as exc:
        raise WorkloadError(f"optimizer_state={state!r} runs torchao's optimizers, which are not installed "
                            f"({exc}): {_INSTALL}.") from None
    if state == "8bit":
        cls = ao.AdamW8bit if settings.decoupled else ao.Adam8bit
        return cls(settings.groups)
    if not torch.cuda.is_available():
        raise WorkloadError("optimizer_state='cpu_offload' runs torchao's CPUOffloadOptimizer, which needs CUDA; "
                            "memfit can still estimate it on this machine.")
    return ao.CPUOffloadOptimizer(settings.groups, optimizer_class=settings.torch_class,
                                  minimal_size=OFFLOAD_MINIMAL_SIZE)


def quantized(numel: int) -> bool:
    """Whether torchao keeps an 8-bit state for a parameter of ``numel`` elements (``EIGHT_BIT_MIN_NUMEL``)."""
    return numel >= EIGHT_BIT_MIN_NUMEL and numel % EIGHT_BIT_BLOCK == 0


def eight_bit_state_bytes(numel: int, itemsize: int) -> int:
    """Bytes of one 8-bit moment of a parameter (codes, block scales, code book), or of the full-precision one
    torchao keeps for a small parameter; allocator rounding not included."""
    if not quantized(numel):
        return numel * itemsize
    return numel + 4 * (numel // EIGHT_BIT_BLOCK) + 4 * EIGHT_BIT_QMAP


def offloaded(p: torch.Tensor) -> bool:
    """Whether ``CPUOffloadOptimizer`` moves this parameter's update to the CPU (``OFFLOAD_MINIMAL_SIZE``)."""
    return p.requires_grad and p.numel() >= OFFLOAD_MINIMAL_SIZE


def optimizer_states_for(optimizer: torch.optim.Optimizer) -> tuple[OptimizerState, ...]:
    """The ``Workload.optimizer_state`` values this optimizer takes: all three for Adam/AdamW, else ``full``."""
    try:
        adam_settings(optimizer)
    except WorkloadError:
        return ("full",)
    return OPTIMIZER_STATES
