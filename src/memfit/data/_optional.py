"""Lazy import of the optional data dependencies, with an error that names the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

from memfit.errors import MissingExtraError


def require(module: str, purpose: str) -> ModuleType:
    """Import ``module`` or raise :class:`MissingExtraError` naming ``pip install memfit[data]``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:  # the extra is optional: say exactly what to install
        raise MissingExtraError(
            f"{purpose} needs the optional package {module!r}, which is not installed. "
            f"Install it with: pip install 'memfit[data]'"
        ) from exc
