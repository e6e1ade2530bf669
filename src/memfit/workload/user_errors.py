"""Whose fault an exception is: the user's code (the workload file, its factories, the model, the loss) or memfit's.

memfit runs the user's code inside its own machinery: the protocol that calls the factories, the tracer's dispatch
hook, torch's fake tensors. When that code raises, the user needs one line that names the place in *their* code
(``step.py:11 in forward (module encoder.1, op addmm)``), not forty lines of fake-tensor internals. When memfit's
own code raises, the user needs to hear that it is a memfit bug, not "your training step failed".

The rule: an exception raised by memfit's own code (the innermost frame of its traceback lies in the memfit
package, outside the protocol modules that call the user's factories) is memfit's. Any other is the user's, and
the place named is the innermost frame outside memfit, torch and the standard library.

Example:
    >>> try:
    ...     {}["missing"]
    ... except KeyError as exc:
    ...     print(one_line(exc))
    KeyError: 'missing'
"""

from __future__ import annotations

import os
import sysconfig
import types
from dataclasses import dataclass
from pathlib import Path

from memfit.errors import UserCodeError

_MEMFIT = str(Path(__file__).resolve().parents[1]) + os.sep
# the modules that call the user's factories and forward: an error raised right there (batch[0] of an empty
# batch, a factory called with the wrong arity) is the user's code not fitting the protocol, not a memfit bug
_PROTOCOL = tuple(_MEMFIT + os.path.join("workload", name) for name in ("protocol.py", "spec.py", "loading.py"))
_STDLIB = tuple({str(Path(p).resolve()) + os.sep for p in (sysconfig.get_paths()["stdlib"],
                                                           sysconfig.get_paths()["platstdlib"])})
_MAX_MESSAGE = 300

_HINTS = (
    (("not linked with support for cuda", "Torch not compiled with CUDA", "no NVIDIA driver",
      "found at least two devices, cpu and cuda"),
     "memfit simulates the GPU with CPU tensors: .cuda(), .to(device) and device='cuda' work in the model and "
     "batch factories, but inside forward create tensors on an input's device (x.device)."),
)


@dataclass(frozen=True)
class Place:
    """A frame of the user's code."""

    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{_display_path(self.file)}:{self.line} in {self.function}"


def _display_path(file: str) -> str:
    try:
        rel = os.path.relpath(file)
    except ValueError:  # another drive (Windows)
        return file
    return file if rel.startswith("..") else rel


def _kind(filename: str) -> str:
    """``memfit``, ``protocol``, ``torch``, ``stdlib``, ``generated`` (code without a file), ``library`` (another
    installed package: the user's choice, such as timm, or one of memfit's own dependencies, such as rich) or
    ``user`` (the user's own files)."""
    if filename.startswith("<"):
        # <frozen importlib._bootstrap>; <string>: code made by exec, a dataclass's __init__ say; <stdin>
        return "stdlib" if filename.startswith("<frozen") else "generated"
    path = os.path.realpath(filename)
    if path.startswith(_PROTOCOL):
        return "protocol"
    if path.startswith(_MEMFIT):
        return "memfit"
    # any installed package, also one from another environment's site-packages (a .pth file, PYTHONPATH)
    parts = path.split(os.sep)
    for i in range(len(parts) - 2, -1, -1):
        if parts[i] in ("site-packages", "dist-packages"):
            return "torch" if parts[i + 1] in ("torch", "functorch", "torchgen") else "library"
    if path.startswith(_STDLIB):
        return "stdlib"
    return "user"


def _lines(exc: BaseException) -> list[tuple[types.FrameType, int]]:
    """The traceback's frames and their current lines, outermost first."""
    out = []
    tb = exc.__traceback__
    while tb is not None:
        out.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    return out


def raised_by_memfit(exc: BaseException) -> bool:
    """Whether memfit's own code raised ``exc`` (the innermost frame of its traceback is memfit's)."""
    lines = _lines(exc)
    return bool(lines) and _kind(lines[-1][0].f_code.co_filename) == "memfit"


def user_place(exc: BaseException, *, libraries: bool = False) -> Place | None:
    """The innermost frame of ``exc``'s traceback in the user's own files (or, with ``libraries``, in an installed
    package other than torch, such as the timm model the user chose), or None when it passed through none."""
    kinds = ("user", "library") if libraries else ("user",)
    for frame, line in reversed(_lines(exc)):
        if _kind(frame.f_code.co_filename) in kinds:
            return Place(frame.f_code.co_filename, line, frame.f_code.co_name)
    return None


def memfit_place(exc: BaseException) -> str:
    """Where in memfit ``exc`` was raised, as ``memfit/estimate/op_costs.py:123``."""
    lines = _lines(exc)
    if not lines:
        return "an unknown place"
    frame, line = lines[-1]
    path = os.path.realpath(frame.f_code.co_filename)
    if path.startswith(_MEMFIT):
        path = "memfit" + os.sep + path[len(_MEMFIT):]
    return f"{path}:{line} in {frame.f_code.co_name}"


def one_line(exc: BaseException) -> str:
    """``TypeName: the first line of the message``, at most a few hundred characters (torch appends C++ stacks)."""
    text = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
    if len(text) > _MAX_MESSAGE:
        text = text[: _MAX_MESSAGE - 1] + "…"
    name = type(exc).__name__
    if isinstance(exc, SyntaxError) and exc.lineno is not None:
        return f"{name}: {exc.msg} ({_display_path(exc.filename or '?')}:{exc.lineno})"
    return f"{name}: {text}" if text else name


def hint_for(exc: BaseException) -> str:
    """A sentence on what to do, for the failures that have a known fix; else ''."""
    text = str(exc)
    for needles, hint in _HINTS:
        if any(n in text for n in needles):
            return " " + hint
    return ""


def user_code_error(
    exc: BaseException, *, during: str, module: str | None = None, op: str | None = None,
    require_user_frame: bool = False,
) -> UserCodeError | None:
    """A ``UserCodeError`` naming the place of ``exc`` in the user's code, or None when ``exc`` is memfit's own bug.

    Args:
        exc: what the user's code (or torch, called by it) raised.
        during: what memfit was doing, for the message: ``"building the model"``, ``"the training step"``.
        module: the qualified name of the module whose forward was running, if known.
        op: the ATen op that failed, if known.
        require_user_frame: count ``exc`` as the user's only if it passed through the user's code (for errors
            caught outside the tracer, where torch raising could be memfit calling it wrongly).
    """
    if raised_by_memfit(exc):
        return None
    place = user_place(exc)
    if place is None and require_user_frame:
        return None
    place = place or user_place(exc, libraries=True)
    where = [f"at {place}"] if place is not None else []
    details = ([f"module {module}"] if module else []) + ([f"op {op}"] if op else [])
    if details:
        where.append(f"({', '.join(details)})")
    at = (" " + " ".join(where)) if where else ""
    text = one_line(exc)
    end = "" if text.endswith((".", "…")) else "."
    return UserCodeError(f"{during} failed{at}: {text}{end}{hint_for(exc)}")


def system_exit_message(exc: SystemExit, during: str, stderr_tail: str = "") -> str:
    """One line for a ``sys.exit()`` (or ``argparse``'s) in the user's code while memfit ran it."""
    place = user_place(exc)
    at = f" at {place}" if place is not None else ""
    said = f" ({stderr_tail.strip()})" if stderr_tail.strip() else ""
    if place is not None and place.function != "<module>":
        fix = "Raise an exception there instead, so memfit can say what went wrong."
    else:
        fix = ("Put the script part of the file (argument parsing, the training loop) under "
               "`if __name__ == \"__main__\":`.")
    return f"{during} called sys.exit({exc.code!r}){at}{said}: memfit cannot continue without the workload. {fix}"
