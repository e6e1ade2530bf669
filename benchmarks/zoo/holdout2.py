"""A second fresh draw of real training steps, written down on 2026-11-28 (session 24) *before* memfit estimated
or measured any of them.

The first draw (``holdout.py``) stopped being held out when four fixes were made after seeing it. These steps are
architectures no earlier session traced: timm's newer CNNs, hybrids and ViT variants (RepViT, EfficientFormerV2,
Next-ViT, GC ViT, RegNetZ, GhostNetV2, MambaOut, DaViT, a relative-position ViT, ReXNet), Hugging Face decoders
and encoders not yet seen (Phi-3, StableLM, GPT-J, XLM-R with its 250k vocabulary, DINOv2, HuBERT CTC,
Pegasus, MobileViTV2), torchvision's v2 RetinaNet, a wide ResNet, two video networks and Swin V2, and three
hand-written steps (SimCLR's contrastive loss, sub-pixel super-resolution, attention that returns its weights).
They are reported on their own (tag ``holdout2``): nothing was fitted on them, and any fix made after seeing one
is said to be so in the results.

Each builder follows its library's usual recipe (optimizer, precision, input size) at a batch one GPU trains;
nothing here is resized after a prediction is seen.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipes import (  # noqa: E402
    adamw,
    ce,
    detection_batch,
    hf_loss,
    images,
    lm_entry,
    seq2seq_batch,
    sgd,
    sum_of_losses,
    timm_entry,
)
from recipes import hf_model as _hf
from recipes import tv_model as _tv

from memfit import Workload  # noqa: E402

LIBRARY = "holdout2"
HOLDOUT2 = "holdout2"


_sgd = sgd(nesterov=False)


# --- timm ---------------------------------------------------------------------------------------------------------

_timm_entry = functools.partial(timm_entry, family=HOLDOUT2)


h2_timm_repvit_m1 = _timm_entry("h2_timm_repvit_m1", "repvit_m1", 128, "bf16", adamw(), "cnn")
h2_timm_efficientformerv2_s0 = _timm_entry("h2_timm_efficientformerv2_s0", "efficientformerv2_s0", 128, "fp16",
                                           adamw(), "hybrid")
h2_timm_nextvit_small = _timm_entry("h2_timm_nextvit_small", "nextvit_small", 64, "bf16", adamw(), "hybrid")
h2_timm_gcvit_xxtiny = _timm_entry("h2_timm_gcvit_xxtiny", "gcvit_xxtiny", 64, "bf16", adamw(), "transformer")
h2_timm_regnetz_b16 = _timm_entry("h2_timm_regnetz_b16", "regnetz_b16", 64, "fp16", _sgd, "cnn")
h2_timm_ghostnetv2_100 = _timm_entry("h2_timm_ghostnetv2_100", "ghostnetv2_100", 128, "fp32", _sgd, "cnn")
h2_timm_mambaout_femto = _timm_entry("h2_timm_mambaout_femto", "mambaout_femto", 128, "bf16", adamw(), "cnn")
h2_timm_davit_tiny = _timm_entry("h2_timm_davit_tiny", "davit_tiny", 32, "bf16", adamw(), "transformer")
h2_timm_vit_relpos_small = _timm_entry("h2_timm_vit_relpos_small", "vit_relpos_small_patch16_224", 64, "fp16",
                                       adamw(), "transformer")
h2_timm_rexnet_100 = _timm_entry("h2_timm_rexnet_100", "rexnet_100", 128, "fp32", _sgd, "cnn")


# --- transformers -------------------------------------------------------------------------------------------------

_lm = functools.partial(lm_entry, family=HOLDOUT2)


h2_hf_phi3_small = _lm("h2_hf_phi3_small", _hf(
    "Phi3ForCausalLM", "Phi3Config", vocab_size=32064, hidden_size=1024, intermediate_size=2816,
    num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16, pad_token_id=0,
), 32064, 1024, 4, "bf16", "Phi-3-style decoder (fused qkv and gate-up projections), 8 x 1024")
h2_hf_stablelm_small = _lm("h2_hf_stablelm_small", _hf(
    "StableLmForCausalLM", "StableLmConfig", vocab_size=50304, hidden_size=1024, intermediate_size=2816,
    num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16, partial_rotary_factor=0.25,
), 50304, 1024, 4, "bf16", "StableLM-style decoder (partial rotary, LayerNorm), 8 x 1024")
h2_hf_gptj_small = _lm("h2_hf_gptj_small", _hf(
    "GPTJForCausalLM", "GPTJConfig", vocab_size=50400, n_embd=1024, n_layer=8, n_head=16, rotary_dim=32,
    n_positions=2048,
), 50400, 1024, 4, "fp16", "GPT-J-style decoder (parallel attention and MLP), 8 x 1024")


def _mlm_batch(vocab: int, seq: int) -> Callable[[int], dict[str, torch.Tensor]]:
    def make(n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(5, vocab, (n, seq))
        labels = torch.full((n, seq), -100)
        labels[:, ::7] = ids[:, ::7]  # about 15 % of the tokens scored, as MLM masking does
        return {"input_ids": ids, "labels": labels}

    return make


h2_hf_xlmr_mlm = Workload(
    name="h2_hf_xlmr_mlm", description="XLM-R-style MLM (250,002-token vocabulary), 6 x 768, 256 tokens, bf16",
    model=_hf("XLMRobertaForMaskedLM", "XLMRobertaConfig", vocab_size=250002, hidden_size=768, num_hidden_layers=6,
              num_attention_heads=12, intermediate_size=3072, max_position_embeddings=514),
    batch=_mlm_batch(250002, 256), loss=hf_loss, optimizer=adamw(1e-4, 0.01), batch_size=16, precision="bf16",
    tags=("transformers", HOLDOUT2, "transformer", "encoder"),
)


def _image_batch(size: int, classes: int) -> Callable[[int], dict[str, torch.Tensor]]:
    return lambda n: {"pixel_values": torch.randn(n, 3, size, size), "labels": torch.randint(0, classes, (n,))}


h2_hf_dinov2_small = Workload(
    name="h2_hf_dinov2_small", description="DINOv2-S/14 classifier (layer scale), 224x224, bf16",
    model=_hf("Dinov2ForImageClassification", "Dinov2Config", hidden_size=384, num_attention_heads=6,
              num_labels=1000, image_size=224),
    batch=_image_batch(224, 1000), loss=hf_loss, optimizer=adamw(1e-4), batch_size=64, precision="bf16",
    tags=("transformers", HOLDOUT2, "transformer", "vision", "vit"),
)
h2_hf_mobilevitv2 = Workload(
    name="h2_hf_mobilevitv2", description="MobileViTV2-1.0 classifier (separable linear attention), 256x256, fp16",
    model=_hf("MobileViTV2ForImageClassification", "MobileViTV2Config", num_labels=1000, image_size=256),
    batch=_image_batch(256, 1000), loss=hf_loss, optimizer=adamw(2e-3), batch_size=64, precision="fp16",
    tags=("transformers", HOLDOUT2, "hybrid", "vision"),
)


def _ctc_batch(n: int) -> dict[str, torch.Tensor]:
    # 4 s of 16 kHz audio and 60 characters per sample
    return {"input_values": torch.randn(n, 64000), "labels": torch.randint(1, 32, (n, 60))}


h2_hf_hubert_ctc = Workload(
    name="h2_hf_hubert_ctc", description="HuBERT-base's shape, CTC over 32 characters, 4 s clips, fp16",
    model=_hf("HubertForCTC", "HubertConfig", vocab_size=32, mask_time_prob=0.0), batch=_ctc_batch,
    loss=hf_loss, optimizer=adamw(1e-4), batch_size=8, precision="fp16",
    tags=("transformers", HOLDOUT2, "transformer", "speech", "ctc"),
)


h2_hf_pegasus = Workload(
    name="h2_hf_pegasus", description="Pegasus-style summariser (6 + 6 layers, 512, vocab 96,103), 512 -> 128, bf16",
    model=_hf("PegasusForConditionalGeneration", "PegasusConfig", vocab_size=96103, d_model=512, encoder_layers=6,
              decoder_layers=6, encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=2048,
              decoder_ffn_dim=2048, max_position_embeddings=512),
    batch=seq2seq_batch(96103, 512, 128), forward=lambda m, b: m(input_ids=b[0], labels=b[1]), loss=hf_loss,
    optimizer=adamw(1e-4, 0.0), batch_size=16, precision="bf16",
    tags=("transformers", HOLDOUT2, "transformer", "encoder_decoder"),
)


# --- torchvision --------------------------------------------------------------------------------------------------

h2_tv_retinanet_v2 = Workload(
    name="h2_tv_retinanet_v2", description="torchvision retinanet_resnet50_fpn_v2 (GroupNorm heads, GIoU), 6 objects "
    "per 512x512 image, fp32",
    model=_tv("retinanet_resnet50_fpn_v2", weights_backbone=None, num_classes=91),
    batch=detection_batch(objects=6, min_side=24), forward=lambda m, b: m(b[0], b[1]), loss=sum_of_losses,
    optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, weight_decay=1e-4), batch_size=4,
    precision="fp32", tags=("torchvision", HOLDOUT2, "cnn", "detection"),
)
h2_tv_wide_resnet50 = Workload(
    name="h2_tv_wide_resnet50", description="torchvision wide_resnet50_2, 224x224, bf16, channels_last",
    model=_tv("wide_resnet50_2"), batch=images(224), loss=ce, optimizer=_sgd, batch_size=64, precision="bf16",
    channels_last=True, tags=("torchvision", HOLDOUT2, "cnn"),
)


def _clips(frames: int, size: int, classes: int) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    return lambda n: (torch.randn(n, 3, frames, size, size), torch.randint(0, classes, (n,)))


h2_tv_mc3_18 = Workload(
    name="h2_tv_mc3_18", description="torchvision mc3_18 (mixed 3-D/2-D convolutions), 16 x 112^2 clips, fp16",
    model=_tv("mc3_18", num_classes=400), batch=_clips(16, 112, 400), loss=ce, optimizer=_sgd, batch_size=16,
    precision="fp16", tags=("torchvision", HOLDOUT2, "cnn", "video"),
)
h2_tv_s3d = Workload(
    name="h2_tv_s3d", description="torchvision S3D (separable 3-D convolutions), 32 x 224^2 clips, bf16",
    model=_tv("s3d", num_classes=400), batch=_clips(32, 224, 400), loss=ce, optimizer=_sgd, batch_size=4,
    precision="bf16", tags=("torchvision", HOLDOUT2, "cnn", "video"),
)
h2_tv_swin_v2_t = Workload(
    name="h2_tv_swin_v2_t", description="torchvision swin_v2_t (cosine attention, log-spaced position bias), 256x256, "
    "bf16", model=_tv("swin_v2_t"), batch=images(256), loss=ce, optimizer=adamw(), batch_size=64, precision="bf16",
    tags=("torchvision", HOLDOUT2, "transformer"),
)


# --- hand-written steps -------------------------------------------------------------------------------------------

def _simclr_model() -> nn.Module:
    import torchvision

    encoder = torchvision.models.resnet18(weights=None)
    encoder.fc = nn.Sequential(nn.Linear(512, 512), nn.ReLU(inplace=True), nn.Linear(512, 128))  # projection head
    return encoder


def _two_views(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, 96, 96), torch.randn(n, 3, 96, 96)


def _simclr_forward(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(torch.cat(batch, dim=0))


def _nt_xent(z: torch.Tensor, batch: Any, temperature: float = 0.2) -> torch.Tensor:
    # SimCLR's NT-Xent: every view against all 2n - 1 others, the other view of the same image the positive
    z = F.normalize(z.float(), dim=1)
    n = z.shape[0] // 2
    sim = z @ z.t() / temperature
    sim = sim.masked_fill(torch.eye(2 * n, dtype=torch.bool, device=z.device), float("-inf"))
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(z.device)
    return F.cross_entropy(sim, targets)


h2_simclr_resnet18 = Workload(
    name="h2_simclr_resnet18", description="SimCLR: ResNet-18 + projection head, two 96x96 views, NT-Xent over a "
    "512 x 512 similarity matrix, fp16", model=_simclr_model, batch=_two_views, forward=_simclr_forward,
    loss=_nt_xent, optimizer=adamw(1e-3, 1e-6), batch_size=256, precision="fp16",
    tags=("torch", "torchvision", HOLDOUT2, "cnn", "contrastive"),
)


class _SubPixelSR(nn.Module):
    """An ESPCN/EDSR-style x4 super-resolution network: residual conv blocks, then two PixelShuffle(2) stages."""

    def __init__(self, features: int = 64, blocks: int = 8) -> None:
        super().__init__()
        self.head = nn.Conv2d(3, features, 3, padding=1)
        self.body = nn.ModuleList(nn.Sequential(nn.Conv2d(features, features, 3, padding=1), nn.ReLU(inplace=True),
                                                nn.Conv2d(features, features, 3, padding=1)) for _ in range(blocks))
        self.up = nn.Sequential(nn.Conv2d(features, features * 4, 3, padding=1), nn.PixelShuffle(2),
                                nn.Conv2d(features, features * 4, 3, padding=1), nn.PixelShuffle(2))
        self.tail = nn.Conv2d(features, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.head(x)
        skip = h
        for block in self.body:
            h = h + 0.1 * block(h)
        return self.tail(self.up(h + skip))


def _sr_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.rand(n, 3, 96, 96), torch.rand(n, 3, 384, 384)


def _l1(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.l1_loss(out, batch[1])


h2_superres_x4 = Workload(
    name="h2_superres_x4", description="x4 sub-pixel super-resolution (8 residual blocks, 64 features), 96^2 -> "
    "384^2 patches, L1, fp32", model=_SubPixelSR, batch=_sr_batch, loss=_l1, optimizer=adamw(1e-4, 0.0),
    batch_size=16, precision="fp32", tags=("torch", HOLDOUT2, "cnn", "super_resolution"),
)


class _AttentionWithWeights(nn.Module):
    """A 4-layer encoder whose self-attention returns its head-averaged weights (``need_weights=True``, the default
    of ``nn.MultiheadAttention``), which an auxiliary loss reads: the math path, not the fused kernels."""

    def __init__(self, dim: int = 512, heads: int = 8, layers: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Linear(64, dim)
        self.attn = nn.ModuleList(nn.MultiheadAttention(dim, heads, batch_first=True) for _ in range(layers))
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.ffn = nn.ModuleList(nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
                                 for _ in range(layers))
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.embed(x)
        entropy = h.new_zeros(())
        for attn, norm, ffn in zip(self.attn, self.norms, self.ffn, strict=True):
            a, weights = attn(norm(h), norm(h), norm(h))
            entropy = entropy - (weights * weights.clamp_min(1e-9).log()).sum(-1).mean()
            h = h + a
            h = h + ffn(h)
        return self.head(h.mean(dim=1)), entropy


def _seq_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 512, 64), torch.randint(0, 10, (n,))


def _ce_plus_entropy(out: tuple[torch.Tensor, torch.Tensor], batch: Any) -> torch.Tensor:
    logits, entropy = out
    return F.cross_entropy(logits, batch[1]) + 1e-3 * entropy


h2_attention_weights = Workload(
    name="h2_attention_weights", description="4-layer encoder, attention weights returned and regularised "
    "(entropy), 512 tokens, bf16", model=_AttentionWithWeights, batch=_seq_batch, loss=_ce_plus_entropy,
    optimizer=adamw(3e-4), batch_size=32, precision="bf16", tags=("torch", HOLDOUT2, "transformer"),
)
