"""Batches and losses that several zoo families share.

Every factory here returns plain CPU-free code: tensors are made without a device, so memfit places them on the
device it simulates (fake tensors) or measures (the GPU). Sizes are arguments, so each zoo entry states its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

Batch = Callable[..., Any]


def images(size: int = 224, classes: int = 1000, channels: int = 3) -> Batch:
    """``n -> (images (n, C, size, size), int64 labels (n,))``: ImageNet-style classification."""
    return lambda n: (torch.randn(n, channels, size, size), torch.randint(0, classes, (n,)))


def volumes(size: tuple[int, ...], classes: int, channels: int = 1, label_channel: bool = False) -> Batch:
    """``n -> (volumes (n, C, *size), int64 labels)``: labels (n, *size), or (n, 1, *size) as MONAI's losses
    want them with ``to_onehot_y=True``."""
    def make(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.randint(0, classes, (n, 1, *size) if label_channel else (n, *size))
        return torch.randn(n, channels, *size), labels

    return make


def tokens(vocab: int, seq: int) -> Batch:
    """``n -> int64 token ids (n, seq)``; the ids double as labels for a causal LM (HF shifts them)."""
    return lambda n: torch.randint(0, vocab, (n, seq))


def detection_batch(size: int = 512, objects: int = 8, min_side: int = 16, classes: int = 91, masks: bool = False,
                    keypoints: bool = False) -> Batch:
    """``n -> (list of images, list of targets)`` as torchvision's detectors take them in training: boxes as
    (x1, y1, x2, y2) with sides of at least ``min_side``, labels 1 .. classes - 1, and instance masks or 17 keypoints
    (x, y, visible) inside each box when asked."""
    def make(n: int) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
        imgs, targets = [], []
        for _ in range(n):
            xy = torch.rand(objects, 2) * (size / 2)
            wh = torch.rand(objects, 2) * (size / 4) + min_side
            target = {"boxes": torch.cat([xy, xy + wh], dim=1), "labels": torch.randint(1, classes, (objects,))}
            if masks:
                target["masks"] = torch.randint(0, 2, (objects, size, size), dtype=torch.uint8)
            if keypoints:
                points = xy[:, None, :] + torch.rand(objects, 17, 2) * wh[:, None, :]
                target["keypoints"] = torch.cat([points, torch.ones(objects, 17, 1)], dim=2)
            imgs.append(torch.rand(3, size, size))
            targets.append(target)
        return imgs, targets

    return make


def ce(out: Any, batch: Any) -> torch.Tensor:
    """Cross-entropy of the output against ``batch[1]`` (logits (N, C, ...) against int64 (N, ...))."""
    return F.cross_entropy(out, batch[1])


def hf_loss(out: Any, batch: Any) -> torch.Tensor:
    """The loss a Hugging Face model computed itself from ``labels``."""
    return out.loss


def lm_forward(model: Any, batch: torch.Tensor) -> Any:
    """Causal LM: the ids are their own labels (the model shifts them)."""
    return model(input_ids=batch, labels=batch)


def logits_ce(out: Any, batch: Any) -> torch.Tensor:
    """Cross-entropy on ``out.logits`` (Hugging Face classifiers) against ``batch[1]``."""
    return F.cross_entropy(out.logits, batch[1])


def sum_of_losses(out: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
    """torchvision detection models return a dict of losses in training mode: the step minimises their sum."""
    return sum(out.values())  # type: ignore[return-value]
