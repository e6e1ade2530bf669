"""Load a ``Workload`` the way the CLI names it: ``path/to/file.py``, ``file.py:NAME``, or a built-in name."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from memfit.errors import WorkloadError
from memfit.workload.spec import Workload
from memfit.workload.zoo import builtin_workload


def load_workload(spec: str) -> Workload:
    """Load a workload from ``path/to/file.py``, ``file.py:name``, or a built-in name such as ``resnet50``.

    A file may hold one ``Workload`` (found by type), several (pick one with ``file.py:name``), or a function
    ``name()`` returning one.
    """
    path_part, _, attr = spec.partition(":")
    if not path_part.endswith(".py"):
        return builtin_workload(spec)
    path = Path(path_part)
    if not path.is_file():
        raise WorkloadError(f"workload file not found: {path_part}. Give a .py file or a built-in name.")
    module = _import_file(path)
    if attr:
        if not hasattr(module, attr):
            raise WorkloadError(f"{path_part} has no attribute {attr!r}. Names found: {_workload_names(module)}.")
        value = getattr(module, attr)
        if callable(value) and not isinstance(value, Workload):
            value = value()
        if not isinstance(value, Workload):
            raise WorkloadError(f"{spec} is a {type(value).__name__}, not a memfit.Workload.")
        return value
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


def _import_file(path: Path) -> Any:
    name = f"memfit_user_workload_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise WorkloadError(f"cannot import {path}: not a Python file.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the user's code: report its failure in one line, never a traceback
        raise WorkloadError(f"importing {path} failed: {type(exc).__name__}: {exc}") from exc
    return module


def _workload_names(module: Any) -> str:
    names = [n for n, v in vars(module).items() if isinstance(v, Workload)]
    return ", ".join(names) or "none"
