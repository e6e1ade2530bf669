"""How long a training step takes: a roofline of the traced ops, calibrated on a GPU when one is present.

Names load on first use (``memfit._lazy``), so importing the package stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memfit._lazy import load_export as _load_export

_EXPORTS: dict[str, str] = {
    "predict_step_time": "memfit.speed.step_time",
    "calibrate": "memfit.speed.step_time",
    "SpeedParams": "memfit.speed.step_time",
    "SpeedPrediction": "memfit.speed.step_time",
    "Calibration": "memfit.speed.step_time",
    "choose_speed_model": "memfit.speed.model_choice",
    "SpeedModel": "memfit.speed.model_choice",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    return _load_export(__name__, _EXPORTS, name)


if TYPE_CHECKING:  # pragma: no cover - what type checkers and IDEs see
    from memfit.speed.model_choice import SpeedModel as SpeedModel
    from memfit.speed.model_choice import choose_speed_model as choose_speed_model
    from memfit.speed.step_time import Calibration as Calibration
    from memfit.speed.step_time import SpeedParams as SpeedParams
    from memfit.speed.step_time import SpeedPrediction as SpeedPrediction
    from memfit.speed.step_time import calibrate as calibrate
    from memfit.speed.step_time import predict_step_time as predict_step_time
