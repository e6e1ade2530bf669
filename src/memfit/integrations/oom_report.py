"""One block of text that says what an out-of-memory error means, for the integrations to show where it happened.

The numbers come from the OOM message (``memfit.explain.oom_message``) and what they mean from
``memfit.explain.oom_diagnosis``, as ``memfit explain --oom`` says them; with the workload's ``Estimate`` the block
also says whether the step as estimated fits the GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memfit.errors import OptimizerStepOOMError, StepOOMError, UsageError
from memfit.explain.oom_diagnosis import diagnose_oom
from memfit.explain.oom_message import parse_oom_message
from memfit.guard.oom import is_oom

if TYPE_CHECKING:
    from memfit.estimate.predict import Estimate

__all__ = ["oom_report", "oom_text"]

_HEADER = "memfit: training ran out of GPU memory."


def oom_text(exc: BaseException) -> str | None:
    """The text of the OOM behind ``exc`` (its own, or the message of memfit's guard that gave up), or None."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (StepOOMError, OptimizerStepOOMError)):
            return str(current)  # the guard's message quotes the OOM it could not get past
        if is_oom(current):
            return f"{type(current).__name__}: {current}"
        current = current.__cause__ or current.__context__
    return None


def oom_report(exc: BaseException, *, estimate: Estimate | None = None) -> str | None:
    """What the OOM behind ``exc`` means, as one block of lines; None when ``exc`` is not an out-of-memory error.

    Example:
        >>> import torch
        >>> print(oom_report(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
        ...     "total capacity of 8.00 GiB of which 0 bytes is free.")).splitlines()[1])
          - PyTorch asked for 2.00 GiB on GPU 0; the GPU had 0 B free of 8.00 GiB.
    """
    text = oom_text(exc)
    if text is None:
        return None
    try:
        findings = diagnose_oom(parse_oom_message(text), estimate).findings
    except UsageError as why:  # a message without numbers (a library's cudaMalloc), or a format memfit lacks
        findings = [f"memfit could not read numbers from this message ({why})"]
    lines = [_HEADER, *(f"  - {f}" for f in findings)]
    lines.append("  `memfit explain` on this step says what fills memory and what would make it fit; "
                 "`memfit plan` finds a configuration that fits.")
    return "\n".join(lines)
