"""Tensor values the trace reads but fake tensors do not have: conditions, ``.item()``, random draws.

The recorder (``memfit.estimate.recorder``, through ``memfit.estimate.step_values``) answers what it can from
known values; what it cannot, it hands to the driver (``memfit.estimate.trace``) as ``ValuesNeededToTrace``,
which traces again with the values of one random batch or of one real CPU forward. This module holds what both
sides name: where in the user's code a value was read (``user_frame``), the random ops and their largest draws,
and the errors that ask the driver for values. (``.numpy()`` is hooked by the driver, which enters the hook
around the steps.)
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path
from typing import Any

import torch

__all__ = ["CONDITION", "RANDOM_OPS", "ValuesNeededToBuild", "ValuesNeededToTrace", "in_initializer",
           "draw_range", "reads", "user_frame", "user_location", "where"]


# frames in these folders are torch's or memfit's own; the first other frame is where the user's code is
_LIBRARY_DIRS = (str(Path(torch.__file__).parent) + os.sep, str(Path(__file__).parents[1]) + os.sep)


def user_location() -> traceback.FrameSummary | None:
    """The innermost frame in the user's code (not torch's, not memfit's), or None."""
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(_LIBRARY_DIRS) and not frame.filename.startswith("<"):
            return frame
    return None


def user_frame() -> str:
    """``file.py:LINE in function`` of the innermost frame in the user's code (not torch's, not memfit's)."""
    frame = user_location()
    return "an unknown place" if frame is None else where(frame)


def where(frame: traceback.FrameSummary) -> str:
    """``file.py:LINE in function`` of ``frame``."""
    return f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}"


_INIT_FILE = str(Path(torch.nn.init.__file__))


def in_initializer() -> bool:
    """The running code is inside one of ``torch.nn.init``'s parameter initializers."""
    return any(frame.filename == _INIT_FILE for frame in traceback.extract_stack())


RANDOM_OPS = frozenset(
    "rand rand_like randn randn_like randint randint_like randperm bernoulli normal multinomial "
    "bernoulli_ normal_ uniform_ exponential_ geometric_ cauchy_ log_normal_ random_".split())
"""Ops that draw from the random generator (as ``memfit._torch_private.op_short_name`` names them). Not dropout:
its output is its input's values, scaled, so a condition on a dropped-out activation (DETR's matcher checks the
predicted boxes) is a condition on the model's values, which the real forward decides."""


def draw_range(name: str, args: Any, kwargs: dict[str, Any], out: Any) -> tuple[float, float | int] | None:
    """The smallest and the largest value a one-element draw of ``name`` can take, or None for other draws.

    A draw read as a number in forward usually picks a size: torchvision's detection transform resizes each
    training batch to ``min_size[int(torch.empty(1).uniform_(0, len(min_size)).item())]`` (multi-scale training,
    Keypoint R-CNN's default). The largest value picks the largest scale, the step's largest memory, and the real
    forward and the trace then read the same number."""
    if not isinstance(out, torch.Tensor) or out.numel() != 1:
        return None
    if name == "uniform_":  # (self, from=0, to=1): values in [from, to)
        low = args[1] if len(args) > 1 else kwargs.get("from", 0.0)
        high = args[2] if len(args) > 2 else kwargs.get("to", 1.0)
    elif name in ("rand", "rand_like"):
        low, high = 0.0, 1.0
    elif name in ("randint", "randint_like"):  # (high, size) or (low, high, size): integers in [low, high)
        ints = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
        if not ints:
            return None
        return (ints[0] if len(ints) > 1 else 0), (ints[1] if len(ints) > 1 else ints[0]) - 1
    else:
        return None
    if out.is_floating_point():  # the largest value below `high` in the draw's own precision
        return float(low), float(torch.nextafter(torch.tensor(float(high), dtype=out.dtype),
                                                 torch.tensor(float(low), dtype=out.dtype)))
    return None


def reads(storages: Any, args: Any) -> bool:
    """Whether any tensor among ``args`` (nested in lists) has its storage in ``storages``."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.layout == torch.strided and a.untyped_storage() in storages:
                return True
        elif isinstance(a, (list, tuple)) and reads(storages, a):
            return True
    return False


CONDITION = "a condition on tensor values"
"""What ``ValuesNeededToTrace`` names for a ``bool()`` of a value the trace does not have (an ``if`` on a tensor)."""


class ValuesNeededToTrace(Exception):
    """An op of the step sizes its output by values computed from data: (op, where in the user's code, whether
    the values come from the model's parameters, so that the batch's values cannot decide them, and the bytes of
    the model's parameters)."""


class ValuesNeededToBuild(Exception):
    """The model's constructor sizes a tensor by tensor values (``torch.unique``), which fake tensors lack."""
