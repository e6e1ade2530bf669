"""Model builders, batches and losses that several zoo families share.

Every factory here returns plain CPU-free code: tensors are made without a device, so memfit places them on the
device it simulates (fake tensors) or measures (the GPU). Sizes are arguments, so each zoo entry states its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from memfit import Workload

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


def timm_model(name: str, **kwargs: Any) -> Callable[[], torch.nn.Module]:
    """A timm model with random weights (``pretrained=False``)."""
    def build() -> torch.nn.Module:
        import timm

        return timm.create_model(name, pretrained=False, **kwargs)

    return build


def hf_model(model_class: str, config_class: str, checkpointing: bool = False,
             **config: Any) -> Callable[[], torch.nn.Module]:
    """A Hugging Face model built from its config (random weights); ``checkpointing``: non-reentrant gradient
    checkpointing of every layer, as ``gradient_checkpointing_enable`` does it."""
    def build() -> torch.nn.Module:
        import transformers

        model = getattr(transformers, model_class)(getattr(transformers, config_class)(**config))
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    return build


def tv_model(name: str, **kwargs: Any) -> Callable[[], torch.nn.Module]:
    """A torchvision model without weights."""
    def build() -> torch.nn.Module:
        import torchvision

        return torchvision.models.get_model(name, weights=None, **kwargs)

    return build


def double_conv(cin: int, cout: int, dims: int = 2) -> torch.nn.Sequential:
    """A U-Net stage: two 3 x 3 (x 3) convolutions without bias, each followed by batch norm and an in-place ReLU."""
    conv = torch.nn.Conv3d if dims == 3 else torch.nn.Conv2d
    norm = torch.nn.BatchNorm3d if dims == 3 else torch.nn.BatchNorm2d
    return torch.nn.Sequential(conv(cin, cout, 3, padding=1, bias=False), norm(cout), torch.nn.ReLU(inplace=True),
                               conv(cout, cout, 3, padding=1, bias=False), norm(cout), torch.nn.ReLU(inplace=True))


def encoder(cin: int, widths: tuple[int, ...], dims: int = 2) -> torch.nn.ModuleList:
    """A U-Net's encoder stages: ``double_conv`` from ``cin`` to each of ``widths`` in turn (the pooling between them
    is the caller's)."""
    return torch.nn.ModuleList(double_conv(a, b, dims) for a, b in zip((cin, *widths[:-1]), widths))


def monai_net(name: str, **kwargs: Any) -> Callable[[], torch.nn.Module]:
    """A network of ``monai.networks.nets``."""
    def build() -> torch.nn.Module:
        from monai.networks import nets

        return getattr(nets, name)(**kwargs)

    return build


def smp_model(arch: str, encoder: str, classes: int) -> Callable[[], torch.nn.Module]:
    """A segmentation_models_pytorch model on 3-channel images, its encoder without weights."""
    def build() -> torch.nn.Module:
        import segmentation_models_pytorch as smp

        return getattr(smp, arch)(encoder, encoder_weights=None, in_channels=3, classes=classes)

    return build


def monai_loss(name: str, deep_supervision: bool = False, **kwargs: Any) -> Callable[[Any, Any], torch.Tensor]:
    """A MONAI loss built once per process (it holds no tensors), called as ``loss(logits, labels)``. A list of
    heads (deep supervision) is scored by its first head, or with ``deep_supervision`` by every head, each weighed
    half the one before and compared with the labels resized to it (nearest), as nnU-Net and MONAI's tutorials do."""
    built: list[Any] = []

    def loss(out: Any, batch: Any) -> torch.Tensor:
        if not built:
            from monai import losses

            built.append(getattr(losses, name)(**kwargs))
        if not deep_supervision:
            if isinstance(out, (list, tuple)):  # DynUNet in training returns its heads stacked
                out = out[0]
            return built[0](out, batch[1])
        total = out[0].new_zeros(())
        for i, head in enumerate(out):
            labels = batch[1]
            if head.shape[2:] != labels.shape[2:]:
                labels = F.interpolate(labels.float(), size=head.shape[2:], mode="nearest").long()
            total = total + 0.5**i * built[0](head, labels)
        return total

    return loss


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


def seq2seq_forward(model: Any, batch: Any) -> Any:
    """Encoder-decoder: ``batch`` is (source ids, target ids), the targets the labels (the model shifts them)."""
    return model(input_ids=batch[0], labels=batch[1])


def lm_entry(name: str, model: Callable[[], torch.nn.Module], vocab: int, seq: int, batch_size: int, precision: str,
             what: str, *, family: str, tags: tuple[str, ...] = ()) -> Workload:
    """A causal language model on random ids of ``vocab`` (its own labels), AdamW(3e-4, weight decay 0.1): the fresh
    draws' recipe, tagged ``("transformers", family, "transformer", *tags)``."""
    return Workload(
        name=name, description=f"{what}, vocab {vocab}, {seq} tokens, {precision}", model=model,
        batch=tokens(vocab, seq), forward=lm_forward, loss=hf_loss, optimizer=adamw(3e-4, 0.1),
        batch_size=batch_size, precision=precision,  # type: ignore[arg-type]
        tags=("transformers", family, "transformer", *tags),
    )


def logits_ce(out: Any, batch: Any) -> torch.Tensor:
    """Cross-entropy on ``out.logits`` (Hugging Face classifiers) against ``batch[1]``."""
    return F.cross_entropy(out.logits, batch[1])


def sum_of_losses(out: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
    """torchvision detection models return a dict of losses in training mode: the step minimises their sum."""
    return sum(out.values())  # type: ignore[return-value]


def sgd(*, nesterov: bool) -> Callable[[Any], torch.optim.Optimizer]:
    """``params -> SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4)``: the ImageNet recipe the zoo's CNNs use."""
    return lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-4, nesterov=nesterov)


def adamw(lr: float = 1e-3, wd: float = 0.05) -> Callable[[Any], torch.optim.Optimizer]:
    """``params -> AdamW(params, lr, weight_decay=wd)``."""
    return lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=wd)


def timm_entry(name: str, model: str, batch_size: int, precision: str, optimizer: Callable[[Any], Any], kind: str,
               size: int = 224, *, family: str, channels_last: bool = False) -> Workload:
    """A timm classifier trained with cross-entropy on random ``size`` x ``size`` images, tagged ``("timm",
    family, kind)``; trained channels-last, said so in its description and tagged ``"channels_last"`` too."""
    layout = ("channels_last",) if channels_last else ()
    return Workload(
        name=name, description=", ".join((f"timm {model} at {size}x{size}", precision, *layout)),
        model=timm_model(model), batch=images(size), loss=ce, optimizer=optimizer, batch_size=batch_size,
        precision=precision, channels_last=channels_last, tags=("timm", family, kind, *layout),  # type: ignore[arg-type]
    )


def ctc_audio(seconds: int = 8, rate: int = 16000, characters: int = 32, labels: int = 120) -> Batch:
    """``n -> {"input_values": (n, seconds x rate) waveforms, "labels": (n, labels) ids from 1 up}``: a Hugging
    Face speech model's CTC batch (0 is the blank)."""
    return lambda n: {"input_values": torch.randn(n, rate * seconds),
                      "labels": torch.randint(1, characters, (n, labels))}


def seq2seq_batch(vocab: int, src: int, tgt: int) -> Batch:
    """``n -> (source ids (n, src), target ids (n, tgt))``, ids from 2 up (0 and 1 left to padding and end)."""
    return lambda n: (torch.randint(2, vocab, (n, src)), torch.randint(2, vocab, (n, tgt)))


def box_labels(n: int, objects: int, classes: int) -> list[dict[str, torch.Tensor]]:
    """Per image, ``objects`` boxes as DETR-family models take them: ``class_labels`` and normalised (centre x,
    centre y, width, height) ``boxes``."""
    labels = []
    for _ in range(n):
        centre = torch.rand(objects, 2) * 0.6 + 0.2
        size = torch.rand(objects, 2) * 0.3 + 0.05
        labels.append({"class_labels": torch.randint(0, classes, (objects,)), "boxes": torch.cat([centre, size], 1)})
    return labels
