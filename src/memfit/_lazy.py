"""Lazy exports: a package lists its public names and the module of each; a name's module loads on first use.

This keeps ``import memfit`` and ``import memfit.data`` light (no torch, numpy or rich until a name needs them).
A package uses it from its module-level ``__getattr__`` (PEP 562)::

    from memfit._lazy import load_export as _load_export

    _EXPORTS = {"estimate": "memfit.estimate"}

    def __getattr__(name: str) -> Any:
        return _load_export(__name__, _EXPORTS, name)
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from typing import Any


def load_export(package: str, exports: Mapping[str, str], name: str) -> Any:
    """Import the module that defines ``name``, keep the value on ``package`` (later lookups skip this), return it.

    Raises:
        AttributeError: ``name`` is not one of ``exports``, as Python raises for a missing module attribute.
    """
    module = exports.get(name)
    if module is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    setattr(sys.modules[package], name, value)
    return value
