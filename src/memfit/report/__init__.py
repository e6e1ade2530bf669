"""Showing results: terminal rendering (rich), the self-contained HTML report and its figures (matplotlib).

Names load on first use (``memfit._lazy``), so importing the package stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memfit._lazy import load_export as _load_export

_EXPORTS: dict[str, str] = {
    "write_report": "memfit.report.html",
    "write_pngs": "memfit.report.html",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    return _load_export(__name__, _EXPORTS, name)


if TYPE_CHECKING:  # pragma: no cover - what type checkers and IDEs see
    from memfit.report.html import write_pngs as write_pngs
    from memfit.report.html import write_report as write_report
