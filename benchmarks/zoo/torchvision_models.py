"""torchvision: classification, segmentation, detection (Faster/Mask R-CNN, RetinaNet, SSD with targets) and video.

Random weights: ``weights=None`` and, for detection, ``weights_backbone=None`` (its default downloads ImageNet
weights). Detection models return a dict of losses in training mode; the step minimises their sum.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipes import ce, detection_batch, images, sgd, sum_of_losses  # noqa: E402
from recipes import tv_model as _tv

from memfit import Workload  # noqa: E402

LIBRARY = "torchvision"


_sgd = sgd(nesterov=False)


def _adamw(p: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(p, lr=1e-3, weight_decay=0.05)


def _cls(name: str, model: str, batch_size: int, precision: str, optimizer: Callable[[Any], Any],
         tags: tuple[str, ...], size: int = 224) -> Workload:
    return Workload(
        name=name, description=f"torchvision {model} at {size}x{size}", model=_tv(model), batch=images(size),
        loss=ce, optimizer=optimizer, batch_size=batch_size, precision=precision,  # type: ignore[arg-type]
        tags=("torchvision", "classification", *tags),
    )


tv_resnet50 = _cls("tv_resnet50", "resnet50", 64, "fp32", _sgd, ("cnn",))
tv_resnet18_bf16 = _cls("tv_resnet18_bf16", "resnet18", 256, "bf16", _sgd, ("cnn",))
tv_mobilenet_v3_large = _cls("tv_mobilenet_v3_large", "mobilenet_v3_large", 128, "fp16",
                             lambda p: torch.optim.RMSprop(p, lr=0.064, alpha=0.9, eps=0.0316), ("cnn", "mobile"))
tv_efficientnet_b0 = _cls("tv_efficientnet_b0", "efficientnet_b0", 96, "bf16", _adamw, ("cnn",))
tv_regnet_y_400mf = _cls("tv_regnet_y_400mf", "regnet_y_400mf", 128, "fp32", _sgd, ("cnn",))
tv_vit_b_16 = _cls("tv_vit_b_16", "vit_b_16", 64, "bf16", _adamw, ("transformer", "vit"))
tv_swin_t = _cls("tv_swin_t", "swin_t", 32, "bf16", _adamw, ("transformer", "swin"))
tv_convnext_tiny = _cls("tv_convnext_tiny", "convnext_tiny", 32, "fp16", _adamw, ("cnn",))


def _seg_loss(out: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
    # torchvision's reference recipe: main head + 0.5 * auxiliary head, 255 = ignore
    return F.cross_entropy(out["out"], batch[1], ignore_index=255) + 0.5 * F.cross_entropy(
        out["aux"], batch[1], ignore_index=255)


def _seg_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, 480, 480), torch.randint(0, 21, (n, 480, 480))


tv_deeplabv3_resnet50 = Workload(
    name="tv_deeplabv3_resnet50", description="DeepLabV3-ResNet50 + aux head, 21 classes, 480x480",
    model=_tv("deeplabv3_resnet50", weights_backbone=None, num_classes=21, aux_loss=True), batch=_seg_batch,
    loss=_seg_loss, optimizer=_sgd, batch_size=4, precision="fp16",
    tags=("torchvision", "cnn", "segmentation", "2d"),
)
tv_fcn_resnet50 = tv_deeplabv3_resnet50.replace(
    name="tv_fcn_resnet50", description="FCN-ResNet50 + aux head, 21 classes, 480x480",
    model=_tv("fcn_resnet50", weights_backbone=None, num_classes=21, aux_loss=True), precision="fp32",
)


def _det(name: str, model: str, masks: bool = False, **kwargs: Any) -> Workload:
    return Workload(
        name=name, description=f"torchvision {model}, 91 classes, 8 boxes per 512x512 image",
        model=_tv(model, weights_backbone=None, num_classes=91, **kwargs), batch=detection_batch(masks=masks),
        forward=lambda m, b: m(b[0], b[1]), loss=sum_of_losses,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.9, weight_decay=1e-4), batch_size=4,
        precision="fp32", tags=("torchvision", "cnn", "detection"),
    )


tv_fasterrcnn_resnet50_fpn = _det("tv_fasterrcnn_resnet50_fpn", "fasterrcnn_resnet50_fpn")
tv_fasterrcnn_mobilenet = _det("tv_fasterrcnn_mobilenet", "fasterrcnn_mobilenet_v3_large_fpn")
tv_maskrcnn_resnet50_fpn = _det("tv_maskrcnn_resnet50_fpn", "maskrcnn_resnet50_fpn", masks=True)
tv_retinanet_resnet50_fpn = _det("tv_retinanet_resnet50_fpn", "retinanet_resnet50_fpn")
tv_ssdlite = _det("tv_ssdlite", "ssdlite320_mobilenet_v3_large")


def _clips(frames: int, size: int, classes: int = 400) -> Callable[[int], Any]:
    return lambda n: (torch.randn(n, 3, frames, size, size), torch.randint(0, classes, (n,)))


tv_r3d_18 = Workload(
    name="tv_r3d_18", description="R3D-18 video classifier, 16 frames of 112x112, Kinetics-400",
    model=_tv("r3d_18"), batch=_clips(16, 112), loss=ce, optimizer=_sgd, batch_size=16, precision="fp16",
    tags=("torchvision", "cnn", "video", "3d"),
)
tv_r2plus1d_18 = tv_r3d_18.replace(name="tv_r2plus1d_18", description="R(2+1)D-18, 16 frames of 112x112",
                                   model=_tv("r2plus1d_18"), precision="bf16", batch_size=8)
tv_mvit_v2_s = Workload(
    name="tv_mvit_v2_s", description="MViT-v2-S video transformer, 16 frames of 224x224, Kinetics-400",
    model=_tv("mvit_v2_s"), batch=_clips(16, 224), loss=ce, optimizer=_adamw, batch_size=2, precision="bf16",
    tags=("torchvision", "transformer", "video", "3d"),
)
