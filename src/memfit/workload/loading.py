"""Load a ``Workload`` the way the CLI names it: ``path/to/file.py``, ``file.py:NAME``, or a built-in name.

A workload file is imported the way ``python file.py`` would run it, so that what works there works here: its
folder is first on ``sys.path`` (a sibling ``import model`` works from any directory), and ``sys.argv`` is just
the file while it imports (a module-level ``argparse`` parses no memfit options). Its ``__name__`` is not
``"__main__"``, so a training loop under ``if __name__ == "__main__":`` does not run.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import io
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

from memfit.errors import MemfitError, WorkloadError
from memfit.workload.spec import Workload
from memfit.workload.user_errors import system_exit_message, user_code_error, user_place
from memfit.workload.zoo import builtin_workload

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def split_spec(spec: str) -> tuple[str, str]:
    """``(path, name)`` of ``file.py[:name]``; ``("", "")`` for a built-in name.

    The name follows the *last* colon, and only when the text before it is a ``.py`` path, so a folder with a
    colon in its name (``runs/2024-01-01T10:00/step.py``) still loads.
    """
    try:
        exists = Path(spec).exists()
    except (OSError, ValueError):  # a name too long for a path, or holding a NUL: not a file
        exists = False
    if spec.endswith(".py") or exists:
        return spec, ""
    head, colon, tail = spec.rpartition(":")
    if colon and head.endswith(".py"):
        return head, tail
    return "", ""


def load_workload(spec: str) -> Workload:
    """Load a workload from ``path/to/file.py``, ``file.py:name``, or a built-in name such as ``resnet50``.

    A file may hold one ``Workload`` (found by type), several (pick one with ``file.py:name``), or a function
    ``name()`` returning one.

    Raises:
        WorkloadError: the file or name cannot be found or does not hold a workload.
        UserCodeError: the file's own code raised while importing it or calling its factory (file and line named).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise WorkloadError(f"name a workload: a built-in (see `memfit list`) or path/to/file.py, got {spec!r}.")
    path_part, attr = split_spec(spec)
    if not path_part:
        return builtin_workload(spec)
    path = Path(path_part)
    try:
        path.stat()
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise WorkloadError(f"cannot read the workload file {path_part[:80]!r}: {reason}.") from None
    if path.is_dir():
        raise WorkloadError(f"{path_part} is a folder, not a workload file. Name the .py file inside it.")
    if not path.is_file():
        raise WorkloadError(f"workload file not found: {path_part}. Give a .py file or a built-in name.")
    if path.suffix != ".py":
        raise WorkloadError(f"{path_part} is not a Python file: give a .py file or a built-in name.")
    if attr and not _NAME.match(attr):
        raise WorkloadError(f"{attr!r} after the colon in {spec!r} is not a Python name: write {path_part}:NAME.")
    module = _import_file(path)
    if attr:
        return _named(module, path_part, attr)
    found = {n: v for n, v in vars(module).items() if isinstance(v, Workload)}
    if len(found) == 1:
        return next(iter(found.values()))
    if not found:
        raise WorkloadError(
            f"{path_part} defines no memfit.Workload. Add e.g. `workload = memfit.Workload(model=..., batch=..., "
            "loss=..., optimizer=..., batch_size=...)`."
        )
    raise WorkloadError(
        f"{path_part} defines several workloads ({', '.join(sorted(found))}): pick one with {path_part}:NAME."
    )


def _named(module: Any, path_part: str, attr: str) -> Workload:
    """``file.py:attr``: the Workload ``attr``, or what calling the function ``attr()`` returns."""
    if not hasattr(module, attr):
        raise WorkloadError(f"{path_part} has no attribute {attr!r}. Workloads found: {_workload_names(module)}.")
    value = getattr(module, attr)
    if isinstance(value, Workload):
        return value
    if isinstance(value, type) or not callable(value):
        raise WorkloadError(f"{path_part}:{attr} is a {_kind_of(value)}, not a memfit.Workload or a function "
                            "returning one.")
    try:
        inspect.signature(value).bind()
    except TypeError:
        raise WorkloadError(
            f"{path_part}:{attr} needs arguments {inspect.signature(value)}, but memfit calls it with none. Give "
            "its parameters defaults, or name a Workload (or a function of no arguments returning one)."
        ) from None
    except ValueError:  # no signature to read (a builtin): just call it
        pass
    with _as_script(Path(path_part)):
        try:
            value = value()
        except SystemExit as exc:
            raise WorkloadError(system_exit_message(exc, f"{path_part}:{attr}()")) from None
        except Exception as exc:
            _reraise(exc, f"calling {path_part}:{attr}()")
    if not isinstance(value, Workload):
        raise WorkloadError(f"{path_part}:{attr}() returned a {_kind_of(value)}, not a memfit.Workload.")
    return value


def _kind_of(value: Any) -> str:
    return f"class {value.__name__}" if isinstance(value, type) else type(value).__name__


@contextlib.contextmanager
def _as_script(path: Path) -> Iterator[None]:
    """``sys.argv`` is ``[file]`` inside; the file's folder is first on ``sys.path`` from then on (the factories
    may import its siblings later, while memfit builds the model), as it is when Python runs the file."""
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    argv = sys.argv
    sys.argv = [str(path)]
    try:
        yield
    finally:
        sys.argv = argv


def _import_file(path: Path) -> Any:
    name = f"memfit_user_workload_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise WorkloadError(f"cannot import {path}: not a Python file.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    # what the file writes to stderr is held back until it has run: a sys.exit() from argparse then becomes one
    # line quoting argparse's last line, rather than its usage text and then memfit's error
    held = io.StringIO()
    try:
        with _as_script(path), contextlib.redirect_stderr(held):
            spec.loader.exec_module(module)
    except SystemExit as exc:
        sys.modules.pop(name, None)
        tail = next((ln for ln in reversed(held.getvalue().splitlines()) if ln.strip()), "")
        raise WorkloadError(system_exit_message(exc, f"importing {path}", tail)) from None
    except Exception as exc:  # the user's code: report its failure in one line, never a traceback
        sys.modules.pop(name, None)
        sys.stderr.write(held.getvalue())
        if isinstance(exc, OSError) and exc.filename == str(path):
            raise WorkloadError(f"cannot read {path}: {exc.strerror}.") from None
        if isinstance(exc, UnicodeDecodeError):
            raise WorkloadError(f"cannot read {path}: it is not UTF-8 text ({exc.reason} at byte {exc.start}).") from None
        _reraise(exc, f"importing {path}")
    sys.stderr.write(held.getvalue())
    return module


def _reraise(exc: Exception, during: str) -> NoReturn:
    """Raise what the user's code raised as one line naming its place; memfit's own errors go as they are."""
    if isinstance(exc, MemfitError):  # e.g. Workload(...) rejected a field: say where the file asked for it
        place = user_place(exc)
        if place is None or not isinstance(exc, ValueError):
            raise exc
        raise WorkloadError(f"{during}: at {place}: {exc}") from exc
    error = user_code_error(exc, during=during)
    if error is None:
        raise exc  # memfit's own bug: the CLI reports it as one
    raise error from exc


def _workload_names(module: Any) -> str:
    names = [n for n, v in vars(module).items() if isinstance(v, Workload)]
    return ", ".join(names) or "none"
