"""Built-in workloads: ``memfit estimate resnet50 --batch-size 64`` needs no file.

Each entry is a realistic training step with the optimizer and precision its community uses by default.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from memfit.errors import WorkloadError
from memfit.workload.models import GPT, LSTMLanguageModel, ResNet, UNet, ViT, deep_supervision_loss
from memfit.workload.spec import Workload


@dataclass(frozen=True)
class _Entry:
    build: Callable[[], Workload]
    summary: str


def _resnet50() -> Workload:
    import torch

    return Workload(
        name="resnet50",
        description="ResNet-50, ImageNet 224x224, SGD momentum 0.9, cross-entropy",
        model=ResNet,
        batch=lambda n: (torch.randn(n, 3, 224, 224), torch.randint(0, 1000, (n,))),
        loss=lambda out, batch: torch.nn.functional.cross_entropy(out, batch[1]),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-4),
        batch_size=64,
        precision="fp32",
        tags=("cnn", "classification", "2d"),
    )


def _vit_b16() -> Workload:
    import torch

    return Workload(
        name="vit_b16",
        description="ViT-B/16 at 224x224, AdamW, bf16 autocast",
        model=ViT,
        batch=lambda n: (torch.randn(n, 3, 224, 224), torch.randint(0, 1000, (n,))),
        loss=lambda out, batch: torch.nn.functional.cross_entropy(out, batch[1]),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.05),
        batch_size=64,
        precision="bf16",
        tags=("transformer", "classification", "2d"),
    )


def _gpt2(checkpointing: bool) -> Callable[[], Workload]:
    def build() -> Workload:
        import torch

        return Workload(
            name="gpt2-ckpt" if checkpointing else "gpt2",
            description="GPT-2 small (124M) decoder, 1024 tokens, AdamW, bf16 autocast"
            + (", activation checkpointing per block" if checkpointing else ""),
            model=lambda: GPT(checkpointing=checkpointing),
            batch=lambda n: (torch.randint(0, 50257, (n, 1024)), torch.randint(0, 50257, (n, 1024))),
            loss=lambda out, batch: torch.nn.functional.cross_entropy(out.flatten(0, 1), batch[1].flatten()),
            optimizer=lambda p: torch.optim.AdamW(p, lr=6e-4, weight_decay=0.1),
            batch_size=8,
            precision="bf16",
            tags=("transformer", "decoder", "tokens"),
        )

    return build


def _unet2d() -> Workload:
    import torch

    return Workload(
        name="unet2d",
        description="2-D U-Net on 1024x1024 4-band satellite tiles, 6 classes, BatchNorm, AdamW",
        model=lambda: UNet(dims=2, in_channels=4, classes=6, features=(64, 128, 256, 512, 1024), norm="batch",
                           deep_supervision=False),
        batch=lambda n, patch: (torch.randn(n, 4, *patch), torch.randint(0, 6, (n, *patch))),
        patch_size=(1024, 1024),
        patch_multiple=(16, 16),  # 4 stride-2 downsamplings
        loss=lambda out, batch: torch.nn.functional.cross_entropy(out, batch[1]),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
        batch_size=1,
        precision="fp32",
        tags=("cnn", "segmentation", "2d", "unet"),
    )


def _unet3d() -> Workload:
    import torch

    return Workload(
        name="unet3d",
        description="nnU-Net 3d_fullres PlainConvUNet (32..320), 4 modalities, 128^3 patches, deep supervision, "
        "SGD nesterov 0.99, fp16 + GradScaler",
        model=lambda: UNet(dims=3, in_channels=4, classes=4),
        batch=lambda n, patch: (torch.randn(n, 4, *patch), torch.randint(0, 4, (n, *patch))),
        patch_size=(128, 128, 128),
        patch_multiple=(32, 32, 32),  # 5 stride-2 downsamplings, as nnU-Net's 6-stage 3d_fullres
        loss=lambda out, batch: deep_supervision_loss(out, batch[1]),
        optimizer=lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.99, nesterov=True, weight_decay=3e-5),
        batch_size=2,
        precision="fp16",
        tags=("cnn", "segmentation", "3d", "unet"),
    )


def _lstm() -> Workload:
    import torch

    return Workload(
        name="lstm",
        description="2-layer LSTM language model, 1024 hidden, 256 tokens, Adam",
        model=LSTMLanguageModel,
        batch=lambda n: (torch.randint(0, 10000, (n, 256)), torch.randint(0, 10000, (n, 256))),
        loss=lambda out, batch: torch.nn.functional.cross_entropy(out.flatten(0, 1), batch[1].flatten()),
        optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
        batch_size=32,
        precision="fp32",
        tags=("rnn", "tokens"),
    )


def _mlp() -> Workload:
    import torch

    return Workload(
        name="mlp",
        description="A 4-layer MLP of width 4096, Adam (a tiny smoke test)",
        model=lambda: torch.nn.Sequential(
            torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
            torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 10),
        ),
        batch=lambda n: (torch.randn(n, 1024), torch.randint(0, 10, (n,))),
        loss=lambda out, batch: torch.nn.functional.cross_entropy(out, batch[1]),
        optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
        batch_size=256,
        precision="fp32",
        tags=("mlp",),
    )


_ZOO: dict[str, _Entry] = {
    "resnet50": _Entry(_resnet50, "ResNet-50, 224x224, SGD, fp32"),
    "vit_b16": _Entry(_vit_b16, "ViT-B/16, 224x224, AdamW, bf16"),
    "gpt2": _Entry(_gpt2(False), "GPT-2 small, 1024 tokens, AdamW, bf16"),
    "gpt2-ckpt": _Entry(_gpt2(True), "GPT-2 small with activation checkpointing per block"),
    "unet2d": _Entry(_unet2d, "2-D U-Net, 1024x1024 satellite tiles, batch 1"),
    "unet3d": _Entry(_unet3d, "nnU-Net-style 3-D U-Net, 128^3, fp16 + GradScaler"),
    "lstm": _Entry(_lstm, "2-layer LSTM language model"),
    "mlp": _Entry(_mlp, "4-layer MLP (smoke test)"),
}
_ALIASES = {"vit": "vit_b16", "vit-b16": "vit_b16", "gpt": "gpt2", "nnunet": "unet3d", "unet": "unet2d", "rnn": "lstm"}


def builtin_names() -> dict[str, str]:
    """Built-in workload names and one-line summaries."""
    return {name: entry.summary for name, entry in _ZOO.items()}


def builtin_workload(name: str) -> Workload:
    """The built-in workload ``name`` (see ``memfit list``)."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in _ZOO:
        shown = repr(name) if len(name) <= 60 else repr(name[:57] + "...")
        raise WorkloadError(
            f"unknown built-in workload {shown}: choose one of {', '.join(_ZOO)}, or give a .py file."
        )
    return _ZOO[key].build()
