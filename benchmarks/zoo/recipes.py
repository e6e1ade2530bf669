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
