"""How a user describes a training step: the ``Workload``, loading it from a file or the built-in zoo, the knobs memfit turns, and the protocol that runs it.

Names load on first use (``memfit._lazy``), so importing the package stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memfit._lazy import load_export as _load_export

_EXPORTS: dict[str, str] = {
    "Workload": "memfit.workload.spec",
    "Precision": "memfit.workload.spec",
    "PRECISIONS": "memfit.workload.spec",
    "load_workload": "memfit.workload.loading",
    "builtin_workload": "memfit.workload.zoo",
    "builtin_names": "memfit.workload.zoo",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    return _load_export(__name__, _EXPORTS, name)


if TYPE_CHECKING:  # pragma: no cover - what type checkers and IDEs see
    from memfit.workload.loading import load_workload as load_workload
    from memfit.workload.spec import PRECISIONS as PRECISIONS
    from memfit.workload.spec import Precision as Precision
    from memfit.workload.spec import Workload as Workload
    from memfit.workload.zoo import builtin_names as builtin_names
    from memfit.workload.zoo import builtin_workload as builtin_workload
