"""timm image models: CNNs, ViTs, Swin, ConvNeXt, EfficientNet, hybrids. Random weights (``pretrained=False``).

Each entry trains at its model's default input size with the optimizer and precision its timm recipe uses.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipes import ce, images, sgd  # noqa: E402
from recipes import timm_model as _timm

from memfit import Workload  # noqa: E402

LIBRARY = "timm"


_sgd = sgd(nesterov=True)


def _adamw(p: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(p, lr=1e-3, weight_decay=0.05)


def _entry(name: str, model: str, batch_size: int, precision: str, optimizer: Callable[[Any], Any],
           tags: tuple[str, ...], size: int = 224, **kwargs: Any) -> Workload:
    return Workload(
        name=name, description=f"timm {model} at {size}x{size}, {precision}", model=_timm(model, **kwargs),
        batch=images(size), loss=ce, optimizer=optimizer, batch_size=batch_size, precision=precision,  # type: ignore[arg-type]
        tags=("timm", *tags),
    )


timm_resnet50 = _entry("timm_resnet50", "resnet50", 64, "fp16", _sgd, ("cnn",))
timm_resnet18_fp32 = _entry("timm_resnet18_fp32", "resnet18", 128, "fp32", _sgd, ("cnn",))
timm_resnet50_channels_last = _entry("timm_resnet50_channels_last", "resnet50", 64, "bf16", _sgd,
                                     ("cnn", "channels_last")).replace(channels_last=True)
timm_convnext_tiny = _entry("timm_convnext_tiny", "convnext_tiny", 64, "bf16", _adamw, ("cnn",))
timm_convnextv2_atto = _entry("timm_convnextv2_atto", "convnextv2_atto", 128, "bf16", _adamw, ("cnn",))
timm_efficientnet_b0 = _entry("timm_efficientnet_b0", "efficientnet_b0", 128, "fp16",
                              lambda p: torch.optim.RMSprop(p, lr=1e-3, alpha=0.9, eps=1e-3), ("cnn",))
timm_efficientnetv2_s = _entry("timm_efficientnetv2_s", "tf_efficientnetv2_s", 32, "bf16", _adamw, ("cnn",),
                               size=300)
timm_mobilenetv3 = _entry("timm_mobilenetv3", "mobilenetv3_large_100", 128, "bf16", _adamw, ("cnn", "mobile"))
timm_regnety_016 = _entry("timm_regnety_016", "regnety_016", 64, "fp16", _sgd, ("cnn",))
timm_densenet121 = _entry("timm_densenet121", "densenet121", 32, "fp32", _sgd, ("cnn",))
timm_inception_v3 = _entry("timm_inception_v3", "inception_v3", 32, "fp16", _sgd, ("cnn",), size=299)
timm_vgg16_bn = _entry("timm_vgg16_bn", "vgg16_bn", 16, "fp32", _sgd, ("cnn",))
timm_vit_b16 = _entry("timm_vit_b16", "vit_base_patch16_224", 64, "bf16", _adamw, ("transformer", "vit"))
timm_vit_s16_drop_path = _entry("timm_vit_s16_drop_path", "vit_small_patch16_224", 64, "bf16", _adamw,
                                ("transformer", "vit", "drop_path"), drop_path_rate=0.1)
timm_deit_small = _entry("timm_deit_small", "deit_small_patch16_224", 64, "fp16", _adamw, ("transformer", "vit"))
timm_swin_tiny = _entry("timm_swin_tiny", "swin_tiny_patch4_window7_224", 32, "bf16", _adamw,
                        ("transformer", "swin"))
timm_swinv2_tiny = _entry("timm_swinv2_tiny", "swinv2_tiny_window8_256", 16, "bf16", _adamw,
                          ("transformer", "swin"), size=256)
timm_maxvit_tiny = _entry("timm_maxvit_tiny", "maxvit_tiny_tf_224", 16, "bf16", _adamw, ("hybrid",))
timm_levit_128 = _entry("timm_levit_128", "levit_128", 128, "fp32", _adamw, ("hybrid", "attention_bias"))
timm_mixer_b16 = _entry("timm_mixer_b16", "mixer_b16_224", 32, "bf16", _adamw, ("mlp",))
timm_eva02_tiny = _entry("timm_eva02_tiny", "eva02_tiny_patch14_224", 64, "bf16", _adamw,
                         ("transformer", "vit", "rope"))
timm_mobilevit_s = _entry("timm_mobilevit_s", "mobilevit_s", 64, "fp16", _adamw, ("hybrid", "mobile"),
                          size=256)
timm_hrnet_w18_small = _entry("timm_hrnet_w18_small", "hrnet_w18_small", 32, "fp32", _sgd, ("cnn",))
timm_nfnet_l0 = _entry("timm_nfnet_l0", "nfnet_l0", 32, "bf16", _sgd, ("cnn", "no_norm"))
