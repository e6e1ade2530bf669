"""Why doesn't it fit? ``explain()`` breaks the peak down in the model's words and ranks re-estimated fixes; it also reads CUDA out-of-memory messages.

Names load on first use (``memfit._lazy``), so importing the package stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memfit._lazy import load_export as _load_export

_EXPORTS: dict[str, str] = {
    "explain": "memfit.explain.explanation",
    "Explanation": "memfit.explain.explanation",
    "Fix": "memfit.explain.fixes",
    "parse_oom_message": "memfit.explain.oom_message",
    "load_oom_text": "memfit.explain.oom_message",
    "OomMessage": "memfit.explain.oom_message",
    "diagnose_oom": "memfit.explain.oom_diagnosis",
    "OomDiagnosis": "memfit.explain.oom_diagnosis",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    return _load_export(__name__, _EXPORTS, name)


if TYPE_CHECKING:  # pragma: no cover - what type checkers and IDEs see
    from memfit.explain.explanation import Explanation as Explanation
    from memfit.explain.explanation import explain as explain
    from memfit.explain.fixes import Fix as Fix
    from memfit.explain.oom_diagnosis import OomDiagnosis as OomDiagnosis
    from memfit.explain.oom_diagnosis import diagnose_oom as diagnose_oom
    from memfit.explain.oom_message import OomMessage as OomMessage
    from memfit.explain.oom_message import load_oom_text as load_oom_text
    from memfit.explain.oom_message import parse_oom_message as parse_oom_message
