"""segmentation_models_pytorch: U-Net, U-Net++, FPN, DeepLabV3+, Linknet, PSPNet, Segformer over several encoders,
``encoder_weights=None``. Includes issue 13's smp U-Net case (fp16 + GradScaler, Adam, 8 x 3 x 512^2, int64 labels).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipes import ce, volumes  # noqa: E402
from recipes import smp_model as _smp

from memfit import Workload  # noqa: E402

LIBRARY = "segmentation_models_pytorch"


def _dice(out: torch.Tensor, batch: Any) -> torch.Tensor:
    import segmentation_models_pytorch as smp

    return smp.losses.DiceLoss("multiclass", from_logits=True)(out, batch[1]) + ce(out, batch)


def _adam(p: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(p, lr=1e-3)


def _entry(name: str, arch: str, encoder: str, classes: int, batch_size: int, precision: str,
           loss: Callable[[Any, Any], torch.Tensor] = ce, size: int = 512, tags: tuple[str, ...] = ()) -> Workload:
    return Workload(
        name=name, description=f"smp {arch}({encoder}), {classes} classes, {size}x{size}, {precision}",
        model=_smp(arch, encoder, classes), batch=volumes((size, size), classes, channels=3), loss=loss,
        optimizer=_adam, batch_size=batch_size, precision=precision,  # type: ignore[arg-type]
        tags=("segmentation_models_pytorch", "segmentation", "2d", *tags),
    )


# issue 13: predicted 7-18 % off
smp_unet_r34_issue13 = _entry("smp_unet_r34_issue13", "Unet", "resnet34", 2, 8, "fp16", tags=("cnn", "issue13"))
smp_unetplusplus_r50 = _entry("smp_unetplusplus_r50", "UnetPlusPlus", "resnet50", 5, 4, "bf16", _dice,
                              tags=("cnn",))
smp_fpn_effb0 = _entry("smp_fpn_effb0", "FPN", "efficientnet-b0", 7, 8, "fp16", _dice, tags=("cnn",))
smp_deeplabv3plus_r50 = _entry("smp_deeplabv3plus_r50", "DeepLabV3Plus", "resnet50", 19, 8, "fp32",
                               size=512, tags=("cnn",))
smp_linknet_mobilenet = _entry("smp_linknet_mobilenet", "Linknet", "mobilenet_v2", 3, 16, "bf16", tags=("cnn",))
smp_pspnet_r34 = _entry("smp_pspnet_r34", "PSPNet", "resnet34", 11, 8, "fp16", tags=("cnn",))
smp_segformer_mitb0 = _entry("smp_segformer_mitb0", "Segformer", "mit_b0", 150, 8, "bf16",
                             tags=("transformer",))
