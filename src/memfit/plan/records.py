"""What a plan is: a ``Config`` (one training configuration), a ``Candidate`` (a configuration with its predicted
memory and speed) and the ``Plan`` (the chosen candidate and the frontier), with its versioned JSON and the calls
that run it (``Plan.apply``, ``Plan.workload_for``). The search that makes one is ``memfit.plan.search``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from memfit._io import check_output_path, write_atomic
from memfit.errors import UsageError
from memfit.guard.step import TrainStep
from memfit.records import JsonRecord
from memfit.workload.chunked_cross_entropy import use_chunked_cross_entropy
from memfit.workload.knobs import apply_checkpointing, set_optimizer_impl
from memfit.workload.optimizer_state import set_optimizer_state
from memfit.workload.spec import (
    CHECKPOINT_MODES,
    LOSS_IMPLS,
    OPTIMIZER_IMPLS,
    OPTIMIZER_STATES,
    PRECISIONS,
    CheckpointMode,
    LossImpl,
    OptimizerImpl,
    OptimizerState,
    Precision,
    Workload,
)

logger = logging.getLogger(__name__)

SCHEMA = 1


@dataclass(frozen=True, kw_only=True)
class Config:
    """One training configuration: what ``Workload.replace`` and the guarded step need to run it."""

    micro_batch: int
    accumulation_steps: int
    precision: Precision
    checkpoint: tuple[str, ...] = ()
    optimizer_impl: OptimizerImpl = "default"
    channels_last: bool = False
    expandable_segments: bool = False
    patch_size: tuple[int, ...] | None = None
    loss_impl: LossImpl = "default"
    """``chunked``: the output layer and cross-entropy run over chunks of tokens (``Workload.loss_impl``): the same
    loss without the full logits, at the cost of one more output-layer matmul in backward."""
    checkpoint_mode: CheckpointMode = "full"
    """How ``checkpoint``'s blocks are checkpointed (``Workload.checkpoint_mode``): ``full``, ``selective`` (matmul,
    convolution and attention outputs kept) or ``reentrant``."""
    optimizer_state: OptimizerState = "full"
    """``8bit`` or ``cpu_offload``: Adam's moments as torchao keeps them (``Workload.optimizer_state``); changes
    numerics (8-bit) or speed (offload), so the planner tries them only when allowed."""

    def __post_init__(self) -> None:
        for name in ("micro_batch", "accumulation_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"Config.{name} must be a positive integer, got {value!r}.")
        if self.precision not in PRECISIONS:
            raise UsageError(f"Config.precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}.")
        if self.optimizer_impl not in OPTIMIZER_IMPLS:
            raise UsageError(f"Config.optimizer_impl must be one of {', '.join(OPTIMIZER_IMPLS)}, "
                             f"got {self.optimizer_impl!r}.")
        if self.optimizer_state not in OPTIMIZER_STATES:
            raise UsageError(f"Config.optimizer_state must be one of {', '.join(OPTIMIZER_STATES)}, "
                             f"got {self.optimizer_state!r}.")
        if self.loss_impl not in LOSS_IMPLS:
            raise UsageError(f"Config.loss_impl must be one of {', '.join(LOSS_IMPLS)}, got {self.loss_impl!r}.")
        if self.checkpoint_mode not in CHECKPOINT_MODES:
            raise UsageError(f"Config.checkpoint_mode must be one of {', '.join(CHECKPOINT_MODES)}, "
                             f"got {self.checkpoint_mode!r}.")
        if self.patch_size is not None and not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in self.patch_size
        ):
            raise UsageError(f"Config.patch_size must be positive integers, got {self.patch_size!r}.")

    @property
    def effective_batch(self) -> int:
        return self.micro_batch * self.accumulation_steps

    def changes(self) -> dict[str, Any]:
        """The ``Workload`` fields this configuration sets."""
        out: dict[str, Any] = {
            "batch_size": self.micro_batch,
            "accumulation_steps": self.accumulation_steps,
            "precision": self.precision,
            "checkpoint": self.checkpoint,
            "checkpoint_mode": self.checkpoint_mode,
            "optimizer_impl": self.optimizer_impl,
            "channels_last": self.channels_last,
            "loss_impl": self.loss_impl,
            "optimizer_state": self.optimizer_state,
        }
        if self.patch_size is not None:
            out["patch_size"] = self.patch_size
        return out

    def label(self) -> str:
        parts = [f"micro-batch {self.micro_batch} × {self.accumulation_steps}", self.precision]
        if self.checkpoint:
            parts.append(f"checkpoint {len(self.checkpoint)} blocks"
                         + ("" if self.checkpoint_mode == "full" else f" ({self.checkpoint_mode})"))
        if self.optimizer_impl != "default":
            parts.append(f"{self.optimizer_impl} optimizer")
        if self.optimizer_state == "8bit":
            parts.append("8-bit Adam states")
        elif self.optimizer_state == "cpu_offload":
            parts.append("optimizer offloaded to CPU")
        if self.loss_impl == "chunked":
            parts.append("chunked cross-entropy")
        if self.channels_last:
            parts.append("channels_last")
        if self.expandable_segments:
            parts.append("expandable_segments")
        if self.patch_size is not None:
            parts.append("patch " + "×".join(map(str, self.patch_size)))
        return ", ".join(parts)


@dataclass(frozen=True)
class Candidate:
    """A configuration with its predicted memory and speed."""

    config: Config
    device_bytes: int
    """The predicted upper bound on the cap (``Estimate.fits_in_upper_bytes``) + CUDA context: what "fits" is
    decided with."""
    fits_in_bytes: int
    step_time_s: float | None
    """Predicted time of one optimizer step (all micro-batches); None without a speed model."""
    samples_per_s: float | None
    verified: bool
    """True: memory from an estimate of exactly this configuration; False: from the line through two others."""
    fits: bool
    """``device_bytes <= budget × (1 - margin)``."""
    measured_step_s: float | None = None
    """One optimizer step's seconds as timed on the GPU planned for, where the plan settled a near-tie of the speed
    model by running the contenders (``memfit.plan.race``); None where nothing was timed."""


@dataclass(frozen=True)
class Plan(JsonRecord):
    """The chosen configuration and the frontier of alternatives (memory vs step time)."""

    _schema: ClassVar[int] = SCHEMA

    workload: str
    gpu: str
    budget_bytes: int
    margin: float
    effective_batch: int
    chosen: Candidate
    frontier: list[Candidate]
    """Pareto-optimal candidates: none is both smaller and faster than another, by memory. For a patch plan:
    the patches estimated, largest first."""
    considered: int
    """Configurations scored."""
    estimates: int
    """Estimator runs (traces) the search made."""
    speed_model: str
    """``roofline`` or ``calibrated`` (timed on this machine's GPU), or ``none``."""
    notes: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    schema: int = SCHEMA


    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the plan as versioned JSON, atomically: on any failure the file at ``path`` is left as it was.

        Raises:
            UsageError: ``path`` is a directory or in a folder that does not exist, or the write failed (a full
                disk); the message names the path.
        """
        return write_atomic(check_output_path(path, "the plan"), self.to_json(indent=2), what="the plan")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Read a plan written by ``save`` (plain JSON; nothing is unpickled).

        Raises:
            UsageError: the file is missing, unreadable, not JSON, or not a plan of this schema (every field is
                checked: its presence, its type, its range).
        """
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise UsageError(f"plan file not found: {path}.") from None
        except IsADirectoryError:
            raise UsageError(f"cannot read the plan {path}: it is a directory. Name the .json file.") from None
        except OSError as exc:
            raise UsageError(f"cannot read the plan {path}: {exc.strerror or exc}.") from None
        except UnicodeDecodeError as exc:
            raise UsageError(f"cannot read the plan {path}: not UTF-8 text ({exc.reason} at byte {exc.start}). "
                             "Re-run `memfit plan ... --save`.") from None
        except json.JSONDecodeError as exc:
            raise UsageError(f"cannot read the plan {path}: not JSON ({exc.msg}, line {exc.lineno}). "
                             "Re-run `memfit plan ... --save`.") from None
        except RecursionError:
            raise UsageError(f"cannot read the plan {path}: its JSON nests too deeply to be a plan.") from None
        try:
            return cls.from_dict(data)
        except UsageError as exc:
            raise UsageError(f"{path} is not a memfit plan: {exc}") from None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """The plan of a ``to_dict()``, every field checked.

        Raises:
            UsageError: one line naming the first field that is missing, extra, of the wrong type or out of range.
        """
        if not isinstance(data, dict):
            raise UsageError(f"a plan is a JSON object, got {_json_kind(data)}. Re-run `memfit plan ... --save`.")
        if data.get("schema") != SCHEMA:
            raise UsageError(f"plan schema {data.get('schema')!r} is not {SCHEMA}: re-run `memfit plan`.")
        plan = _decode(cls, data, "plan")
        if not 0 <= plan.margin < 0.5 or plan.budget_bytes <= 0 or plan.effective_batch < 1:
            raise UsageError(f"plan.margin, budget_bytes or effective_batch out of range ({plan.margin!r}, "
                             f"{plan.budget_bytes!r}, {plan.effective_batch!r}). Re-run `memfit plan ... --save`.")
        return plan

    def workload_for(self, workload: Workload) -> Workload:
        """``workload`` configured as planned (estimate or measure it to check)."""
        return workload.replace(**self.chosen.config.changes())

    def apply(self, model: Any, optimizer: Any, loss_fn: Any, **train_step_kwargs: Any) -> Any:
        """Configure the guarded step as planned: checkpoint wrappers, the chunked cross-entropy, optimizer
        implementation and state (torchao's 8-bit or offloaded Adam), memory format, precision and micro-batch size. Returns a ``memfit.TrainStep``; its
        ``optimizer`` is the one to use.

        Feed it batches of ``effective_batch`` samples; it runs them as ``accumulation_steps`` micro-batches. With
        the chunked cross-entropy the model computes its loss when called with labels and returns no logits, so
        ``loss_fn`` must take the model's loss (``lambda out, mb: out.loss``), as the planned workload's did.
        """
        import torch

        c = self.chosen.config
        if c.checkpoint:
            apply_checkpointing(model, c.checkpoint, c.checkpoint_mode)
        if c.loss_impl == "chunked":
            use_chunked_cross_entropy(model)
        if c.channels_last:  # .to keeps the Parameter objects, so the optimizer still holds them
            is_3d = any(p.dim() == 5 for p in model.parameters())
            model.to(memory_format=torch.channels_last_3d if is_3d else torch.channels_last)
        optimizer = set_optimizer_state(set_optimizer_impl(optimizer, c.optimizer_impl), c.optimizer_state)
        if c.expandable_segments:
            _enable_expandable_segments()
        return TrainStep(
            model, optimizer, loss_fn, precision=c.precision, micro_batch_size=c.micro_batch, **train_step_kwargs
        )


def _json_kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _decode(tp: Any, value: Any, where: str) -> Any:
    """``value`` (parsed JSON) as the type ``tp`` of a results dataclass field, or a UsageError naming ``where``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, dict):
            raise UsageError(f"{where} must be an object, got {_json_kind(value)}.")
        hints = typing.get_type_hints(tp)
        fields = {f.name: f for f in dataclasses.fields(tp) if f.init}
        extra = sorted(set(value) - set(fields))
        missing = sorted(n for n, f in fields.items() if n not in value and f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING)
        if extra or missing:
            what = "; ".join(([f"missing {', '.join(missing)}"] if missing else [])
                             + ([f"unknown {', '.join(map(str, extra))}"] if extra else []))
            raise UsageError(f"{where} does not match this memfit's plan format ({what}). Re-run `memfit plan`.")
        return tp(**{k: _decode(hints[k], v, f"{where}.{k}") for k, v in value.items()})
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        return _decode(next(a for a in args if a is not type(None)), value, where)
    if origin is list:
        if not isinstance(value, list):
            raise UsageError(f"{where} must be a list, got {_json_kind(value)}.")
        return [_decode(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, list):
            raise UsageError(f"{where} must be a list, got {_json_kind(value)}.")
        return tuple(_decode(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict or tp is Any:
        return value
    if origin is typing.Literal:  # a fixed vocabulary (precision, optimizer implementation): one of its words
        if value not in args:
            raise UsageError(f"{where} must be one of {', '.join(map(repr, args))}, got {value!r}.")
        return value
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
          str: lambda v: isinstance(v, str)}[tp]
    if not ok(value):
        raise UsageError(f"{where} must be {_json_kind(tp())}, got {value!r:.60}.")
    return float(value) if tp is float else value


def _enable_expandable_segments() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        logger.warning(
            "the plan uses expandable_segments, but CUDA is already initialised; set "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the process starts."
        )
        return
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments" not in conf:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, [conf, "expandable_segments:True"]))
