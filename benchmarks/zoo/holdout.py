"""A fresh draw of real training steps, written down on 2026-11-27 *before* memfit estimated or measured any of them.

Everything in the zoo so far was looked at while the estimator was being built: its misses were chased, so its
accuracy is, in part, accuracy on seen data. These steps are new architectures and training tricks that no
session has traced (timm hybrids and ViT variants, decoder LMs with ALiBi / multi-query / QK-norm / logit
soft-capping / selective state spaces, DETR's Hungarian matching, detection and optical flow in torchvision,
MONAI's deep-supervised and backbone U-Nets, smp's newer decoders, a gradient penalty, spectral norm, a Python
loop over decoder steps). They are reported on their own (tag ``holdout``): they tuned nothing, and a fix made
after seeing one is said to be so in the results.

Each builder follows its library's usual recipe (optimizer, precision, input size) at a batch a single GPU
trains; nothing here was resized after a prediction was seen.
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
    box_labels,
    ce,
    detection_batch,
    hf_loss,
    images,
    lm_entry,
    sgd,
    sum_of_losses,
    timm_entry,
    volumes,
)
from recipes import hf_model as _hf
from recipes import monai_loss as _monai_loss
from recipes import monai_net as _monai
from recipes import smp_model as _smp
from recipes import tv_model as _tv

from memfit import Workload  # noqa: E402

LIBRARY = "holdout"
HOLDOUT = "holdout"


_sgd = sgd(nesterov=True)


# --- timm ---------------------------------------------------------------------------------------------------------

_timm_entry = functools.partial(timm_entry, family=HOLDOUT)


ho_timm_pvt_v2_b1 = _timm_entry("ho_timm_pvt_v2_b1", "pvt_v2_b1", 64, "bf16", adamw(), "transformer")
ho_timm_coat_lite_tiny = _timm_entry("ho_timm_coat_lite_tiny", "coat_lite_tiny", 64, "fp16", adamw(), "transformer")
ho_timm_poolformer_s12 = _timm_entry("ho_timm_poolformer_s12", "poolformer_s12", 128, "bf16", adamw(), "cnn")
ho_timm_fastvit_t8 = _timm_entry("ho_timm_fastvit_t8", "fastvit_t8", 128, "bf16", adamw(), "hybrid")
ho_timm_xcit_nano = _timm_entry("ho_timm_xcit_nano", "xcit_nano_12_p16_224", 128, "fp16", adamw(), "transformer")
ho_timm_cait_xxs24 = _timm_entry("ho_timm_cait_xxs24", "cait_xxs24_224", 64, "bf16", adamw(), "transformer")
ho_timm_res2net50 = _timm_entry("ho_timm_res2net50", "res2net50_26w_4s", 64, "fp16", _sgd, "cnn")
ho_timm_dla34 = _timm_entry("ho_timm_dla34", "dla34", 64, "fp32", _sgd, "cnn")
ho_timm_tiny_vit_5m = _timm_entry("ho_timm_tiny_vit_5m", "tiny_vit_5m_224", 128, "bf16", adamw(), "hybrid")
ho_timm_hiera_tiny = _timm_entry("ho_timm_hiera_tiny", "hiera_tiny_224", 64, "bf16", adamw(), "transformer")
ho_timm_edgenext_small = _timm_entry("ho_timm_edgenext_small", "edgenext_small", 64, "fp16", adamw(), "hybrid")
ho_timm_beit_base = _timm_entry("ho_timm_beit_base", "beit_base_patch16_224", 32, "fp16", adamw(), "transformer")


# --- transformers -------------------------------------------------------------------------------------------------

_lm = functools.partial(lm_entry, family=HOLDOUT)


ho_hf_bloom_small = _lm("ho_hf_bloom_small", _hf(
    "BloomForCausalLM", "BloomConfig", vocab_size=250880, hidden_size=1024, n_layer=8, n_head=16,
), 250880, 1024, 2, "bf16", "BLOOM-style decoder (ALiBi), 8 x 1024")
ho_hf_falcon_small = _lm("ho_hf_falcon_small", _hf(
    "FalconForCausalLM", "FalconConfig", vocab_size=65024, hidden_size=1024, num_hidden_layers=8,
    num_attention_heads=16,
), 65024, 1024, 4, "bf16", "Falcon-style decoder (multi-query, parallel attention), 8 x 1024")
ho_hf_qwen3_small = _lm("ho_hf_qwen3_small", _hf(
    "Qwen3ForCausalLM", "Qwen3Config", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
    num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
), 151936, 1024, 2, "bf16", "Qwen3-style decoder (QK-norm, GQA), 8 x 1024")
ho_hf_gemma2_small = _lm("ho_hf_gemma2_small", _hf(
    "Gemma2ForCausalLM", "Gemma2Config", vocab_size=256000, hidden_size=640, intermediate_size=2048,
    num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4, head_dim=128, sliding_window=512,
), 256000, 1024, 2, "bf16", "Gemma-2-style decoder (logit soft-capping, sliding window), 6 x 640")
ho_hf_bigcode_small = _lm("ho_hf_bigcode_small", _hf(
    "GPTBigCodeForCausalLM", "GPTBigCodeConfig", vocab_size=49152, n_embd=1024, n_layer=8, n_head=16,
), 49152, 1024, 4, "fp16", "StarCoder-style decoder (multi-query), 8 x 1024")
ho_hf_mamba_small = _lm("ho_hf_mamba_small", _hf(
    "MambaForCausalLM", "MambaConfig", vocab_size=50280, hidden_size=512, num_hidden_layers=8, state_size=16,
), 50280, 256, 8, "fp32", "Mamba (selective scan, no fused kernels), 8 x 512")
ho_hf_albert_mlm = _lm("ho_hf_albert_mlm", _hf(
    "AlbertForMaskedLM", "AlbertConfig", vocab_size=30000, embedding_size=128, hidden_size=768,
    num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
), 30000, 512, 16, "bf16", "ALBERT-base MLM (one layer's weights shared by 12)")
ho_hf_longformer_mlm = _lm("ho_hf_longformer_mlm", _hf(
    "LongformerForMaskedLM", "LongformerConfig", vocab_size=50265, hidden_size=768, num_hidden_layers=6,
    num_attention_heads=12, intermediate_size=3072, attention_window=256, max_position_embeddings=4098,
), 50265, 2048, 2, "fp16", "Longformer MLM (sliding-window attention, window 256), 6 layers")


def _seq2seq_batch(vocab: int, seq: int) -> Callable[[int], Any]:
    return lambda n: (torch.randint(0, vocab, (n, seq)), torch.randint(0, vocab, (n, seq)))


ho_hf_marian_mt = Workload(
    name="ho_hf_marian_mt", description="Marian translation model (6 + 6 layers, 512), 256 -> 256 tokens, fp16",
    model=_hf("MarianMTModel", "MarianConfig", vocab_size=58101, decoder_vocab_size=58101, d_model=512,
              encoder_layers=6, decoder_layers=6, encoder_attention_heads=8, decoder_attention_heads=8,
              encoder_ffn_dim=2048, decoder_ffn_dim=2048, pad_token_id=58100, decoder_start_token_id=58100),
    batch=_seq2seq_batch(58000, 256), forward=lambda m, b: m(input_ids=b[0], labels=b[1]), loss=hf_loss,
    optimizer=adamw(3e-4, 0.0), batch_size=16, precision="fp16",
    tags=("transformers", HOLDOUT, "transformer", "encoder_decoder"),
)


def _electra_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 30522, (n, 512)), torch.randint(0, 3, (n,))


ho_hf_electra_cls = Workload(
    name="ho_hf_electra_cls", description="ELECTRA-small discriminator, 3-way classification, 512 tokens, fp16",
    model=_hf("ElectraForSequenceClassification", "ElectraConfig", num_labels=3), batch=_electra_batch,
    forward=lambda m, b: m(input_ids=b[0], labels=b[1]), loss=hf_loss, optimizer=adamw(1e-4, 0.01),
    batch_size=64, precision="fp16", tags=("transformers", HOLDOUT, "transformer", "encoder"),
)


def _detr_batch(n: int) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    labels = box_labels(n, 10, 91)  # drawn before the images
    return torch.rand(n, 3, 512, 512), labels


ho_hf_detr = Workload(
    name="ho_hf_detr", description="DETR (ResNet-50 backbone, random weights), Hungarian matching, 4 x 512^2, fp32",
    model=_hf("DetrForObjectDetection", "DetrConfig", use_timm_backbone=False, use_pretrained_backbone=False,
              backbone_config={"model_type": "resnet", "depths": [3, 4, 6, 3], "layer_type": "bottleneck",
                               "hidden_sizes": [256, 512, 1024, 2048], "out_features": ["stage4"]},
              num_labels=91),
    batch=_detr_batch, forward=lambda m, b: m(pixel_values=b[0], labels=b[1]), loss=hf_loss,
    optimizer=adamw(1e-4, 1e-4), batch_size=4, precision="fp32",
    tags=("transformers", HOLDOUT, "detection", "transformer"),
)


# --- torchvision --------------------------------------------------------------------------------------------------

def _tv_det(name: str, model: str, keypoints: bool = False, **kwargs: Any) -> Workload:
    return Workload(
        name=name, description=f"torchvision {model}, 6 objects per 512x512 image", model=_tv(
            model, weights_backbone=None, **kwargs),
        batch=detection_batch(objects=6, min_side=24, classes=2 if keypoints else 91,
                              keypoints=keypoints), forward=lambda m, b: m(b[0], b[1]), loss=sum_of_losses,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, weight_decay=1e-4), batch_size=4,
        precision="fp32", tags=("torchvision", HOLDOUT, "cnn", "detection"),
    )


ho_tv_fcos = _tv_det("ho_tv_fcos", "fcos_resnet50_fpn", num_classes=91)
ho_tv_keypointrcnn = _tv_det("ho_tv_keypointrcnn", "keypointrcnn_resnet50_fpn", keypoints=True, num_classes=2)


def _lraspp_loss(out: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
    return F.cross_entropy(out["out"], batch[1])


ho_tv_lraspp = Workload(
    name="ho_tv_lraspp", description="LR-ASPP MobileNetV3-Large, 21 classes, 512x512, fp16",
    model=_tv("lraspp_mobilenet_v3_large", weights_backbone=None, num_classes=21),
    batch=volumes((512, 512), 21, channels=3), loss=_lraspp_loss, optimizer=_sgd, batch_size=16, precision="fp16",
    tags=("torchvision", HOLDOUT, "cnn", "segmentation", "2d"),
)


def _flow_batch(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.rand(n, 3, 368, 496) * 2 - 1, torch.rand(n, 3, 368, 496) * 2 - 1, torch.randn(n, 2, 368, 496)


def _flow_loss(flows: list[torch.Tensor], batch: Any) -> torch.Tensor:
    # RAFT's sequence loss: later iterations weigh more (gamma 0.8, torchvision's reference recipe)
    n = len(flows)
    return sum(0.8 ** (n - i - 1) * (f - batch[2]).abs().mean() for i, f in enumerate(flows))  # type: ignore[return-value]


ho_tv_raft_small = Workload(
    name="ho_tv_raft_small", description="RAFT-small optical flow, 12 refinement iterations, 368x496, fp32",
    model=_tv("raft_small"), batch=_flow_batch, forward=lambda m, b: m(b[0], b[1], num_flow_updates=12),
    loss=_flow_loss, optimizer=adamw(4e-4, 1e-4), batch_size=8, precision="fp32",
    tags=("torchvision", HOLDOUT, "cnn", "optical_flow"),
)
ho_tv_swin3d_t = Workload(
    name="ho_tv_swin3d_t", description="Video Swin-T, 16 frames of 224x224, Kinetics-400, bf16",
    model=_tv("swin3d_t"), batch=lambda n: (torch.randn(n, 3, 16, 224, 224), torch.randint(0, 400, (n,))),
    loss=ce, optimizer=adamw(), batch_size=4, precision="bf16",
    tags=("torchvision", HOLDOUT, "transformer", "video", "3d"),
)


def _googlenet_loss(out: Any, batch: Any) -> torch.Tensor:
    # torchvision's GoogLeNet in training returns main and two auxiliary logits (0.3 each, the paper's weights)
    return ce(out.logits, batch) + 0.3 * ce(out.aux_logits1, batch) + 0.3 * ce(out.aux_logits2, batch)


ho_tv_googlenet = Workload(
    name="ho_tv_googlenet", description="GoogLeNet with its two auxiliary heads, 224x224, fp16",
    model=_tv("googlenet", aux_logits=True, init_weights=True), batch=images(224), loss=_googlenet_loss,
    optimizer=_sgd, batch_size=128, precision="fp16", tags=("torchvision", HOLDOUT, "cnn"),
)
ho_tv_shufflenet = Workload(
    name="ho_tv_shufflenet", description="ShuffleNetV2 x1.0, 224x224, fp16", model=_tv("shufflenet_v2_x1_0"),
    batch=images(224), loss=ce, optimizer=_sgd, batch_size=256, precision="fp16",
    tags=("torchvision", HOLDOUT, "cnn", "mobile"),
)
ho_tv_maxvit_t = Workload(
    name="ho_tv_maxvit_t", description="torchvision MaxViT-T, 224x224, bf16", model=_tv("maxvit_t"),
    batch=images(224), loss=ce, optimizer=adamw(), batch_size=32, precision="bf16",
    tags=("torchvision", HOLDOUT, "hybrid"),
)


# --- MONAI --------------------------------------------------------------------------------------------------------

def _monai_adamw(p: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(p, lr=1e-4, weight_decay=1e-5)


ho_monai_vnet = Workload(
    name="ho_monai_vnet", description="MONAI VNet, 2 classes, 128^3, DiceLoss, fp16",
    model=_monai("VNet", spatial_dims=3, in_channels=1, out_channels=2),
    batch=volumes((128, 128, 128), 2, label_channel=True),
    loss=_monai_loss("DiceLoss", to_onehot_y=True, softmax=True), optimizer=_monai_adamw, batch_size=2,
    precision="fp16", tags=("monai", HOLDOUT, "cnn", "segmentation", "3d"),
)
ho_monai_segresnet_ds = Workload(
    name="ho_monai_segresnet_ds", description="MONAI SegResNetDS, 3 deep-supervision heads, 4 classes, 128^3, "
    "DiceCELoss, bf16",
    model=_monai("SegResNetDS", spatial_dims=3, in_channels=1, out_channels=4, init_filters=32, dsdepth=3),
    batch=volumes((128, 128, 128), 4, label_channel=True),
    loss=_monai_loss("DiceCELoss", deep_supervision=True, to_onehot_y=True, softmax=True),
    optimizer=_monai_adamw, batch_size=2, precision="bf16", tags=("monai", HOLDOUT, "cnn", "segmentation", "3d"),
)
ho_monai_flexible_unet = Workload(
    name="ho_monai_flexible_unet", description="MONAI FlexibleUNet (EfficientNet-B0 encoder), 3 classes, 512x512, "
    "DiceFocalLoss, fp16",
    model=_monai("FlexibleUNet", in_channels=3, out_channels=3, backbone="efficientnet-b0", pretrained=False,
                 spatial_dims=2),
    batch=volumes((512, 512), 3, channels=3, label_channel=True),
    loss=_monai_loss("DiceFocalLoss", to_onehot_y=True, softmax=True), optimizer=_monai_adamw, batch_size=8,
    precision="fp16", tags=("monai", HOLDOUT, "cnn", "segmentation", "2d"),
)
ho_monai_unetpp_ds = Workload(
    name="ho_monai_unetpp_ds", description="MONAI BasicUNetPlusPlus with deep supervision, 2 classes, 384x384, "
    "DiceCELoss, fp32",
    model=_monai("BasicUNetPlusPlus", spatial_dims=2, in_channels=1, out_channels=2, deep_supervision=True),
    batch=volumes((384, 384), 2, label_channel=True),
    loss=_monai_loss("DiceCELoss", deep_supervision=True, to_onehot_y=True, softmax=True),
    optimizer=_monai_adamw, batch_size=8, precision="fp32", tags=("monai", HOLDOUT, "cnn", "segmentation", "2d"),
)
ho_monai_highresnet = Workload(
    name="ho_monai_highresnet", description="MONAI HighResNet (dilated 3-D), 3 classes, 96^3, "
    "GeneralizedDiceLoss, fp16",
    model=_monai("HighResNet", spatial_dims=3, in_channels=1, out_channels=3),
    batch=volumes((96, 96, 96), 3, label_channel=True),
    loss=_monai_loss("GeneralizedDiceLoss", to_onehot_y=True, softmax=True), optimizer=_monai_adamw,
    batch_size=2, precision="fp16", tags=("monai", HOLDOUT, "cnn", "segmentation", "3d"),
)


# --- segmentation_models_pytorch ----------------------------------------------------------------------------------

def _smp_entry(name: str, arch: str, encoder: str, classes: int, batch_size: int, precision: str) -> Workload:
    return Workload(
        name=name,
        description=f"smp {arch}({encoder}), {classes} classes, 512x512, {precision}",
        model=_smp(arch, encoder, classes), batch=volumes((512, 512), classes, channels=3), loss=ce,
        optimizer=lambda p: torch.optim.Adam(p, lr=1e-4), batch_size=batch_size, precision=precision,  # type: ignore[arg-type]
        tags=("segmentation_models_pytorch", HOLDOUT, "cnn", "segmentation", "2d"),
    )


ho_smp_upernet_resnet50 = _smp_entry("ho_smp_upernet_resnet50", "UPerNet", "resnet50", 6, 8, "fp16")
ho_smp_manet_resnet34 = _smp_entry("ho_smp_manet_resnet34", "MAnet", "resnet34", 4, 8, "bf16")
ho_smp_pan_resnext50 = _smp_entry("ho_smp_pan_resnext50", "PAN", "resnext50_32x4d", 9, 8, "fp32")


# --- plain torch: training tricks -----------------------------------------------------------------------------------

class _Critic(nn.Module):
    """A DCGAN-style 128x128 critic (LayerNorm-free, as WGAN-GP asks), optionally spectrally normalised."""

    def __init__(self, spectral: bool = False) -> None:
        super().__init__()
        wrap = nn.utils.parametrizations.spectral_norm if spectral else (lambda m: m)
        layers: list[nn.Module] = []
        channels = [3, 64, 128, 256, 512, 512]
        for a, b in zip(channels, channels[1:], strict=False):
            layers += [wrap(nn.Conv2d(a, b, 4, stride=2, padding=1)), nn.LeakyReLU(0.2)]
        self.body = nn.Sequential(*layers)
        self.head = wrap(nn.Linear(512 * 4 * 4, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).flatten(1))


def _gp_forward(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    real, fake = batch
    eps = torch.rand(real.shape[0], 1, 1, 1, device=real.device)
    mixed = (eps * real + (1 - eps) * fake).requires_grad_(True)
    score = model(mixed)
    (grad,) = torch.autograd.grad(score.sum(), mixed, create_graph=True)
    return model(real), model(fake), grad


def _gp_loss(out: Any, batch: Any) -> torch.Tensor:
    real, fake, grad = out
    penalty = ((grad.flatten(1).norm(dim=1) - 1) ** 2).mean()
    return fake.mean() - real.mean() + 10 * penalty


def _gan_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, 128, 128), torch.randn(n, 3, 128, 128)


ho_wgan_gp_critic = Workload(
    name="ho_wgan_gp_critic", description="WGAN-GP critic step (gradient penalty: double backward), 128x128, fp32",
    model=_Critic, batch=_gan_batch, forward=_gp_forward, loss=_gp_loss,
    optimizer=lambda p: torch.optim.Adam(p, lr=1e-4, betas=(0.0, 0.9)), batch_size=64, precision="fp32",
    tags=("torch", HOLDOUT, "gan", "double_backward"),
)


def _hinge_forward(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return model(batch[0]), model(batch[1])


def _hinge_loss(out: Any, batch: Any) -> torch.Tensor:
    return F.relu(1 - out[0]).mean() + F.relu(1 + out[1]).mean()


ho_sngan_critic = Workload(
    name="ho_sngan_critic", description="spectral-norm critic, hinge loss, 128x128, bf16",
    model=lambda: _Critic(spectral=True), batch=_gan_batch, forward=_hinge_forward, loss=_hinge_loss,
    optimizer=lambda p: torch.optim.Adam(p, lr=2e-4, betas=(0.0, 0.9)), batch_size=128, precision="bf16",
    tags=("torch", HOLDOUT, "gan", "parametrization"),
)


class _Seq2SeqAttention(nn.Module):
    """A GRU encoder and an LSTMCell decoder with additive attention, unrolled step by step in Python with teacher
    forcing, as many hand-written sequence models are."""

    def __init__(self, vocab: int = 8000, dim: int = 512) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.encoder = nn.GRU(dim, dim, batch_first=True, bidirectional=True)
        self.bridge = nn.Linear(2 * dim, dim)
        self.cell = nn.LSTMCell(3 * dim, dim)
        self.score = nn.Linear(dim, 2 * dim, bias=False)
        self.out = nn.Linear(3 * dim, vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        memory, _ = self.encoder(self.embed(src))
        h = torch.tanh(self.bridge(memory.mean(1)))
        c = torch.zeros_like(h)
        logits = []
        for t in range(tgt.shape[1]):
            weights = torch.softmax(torch.bmm(memory, self.score(h).unsqueeze(2)).squeeze(2), dim=1)
            context = torch.bmm(weights.unsqueeze(1), memory).squeeze(1)
            h, c = self.cell(torch.cat([self.embed(tgt[:, t]), context], dim=1), (h, c))
            logits.append(self.out(torch.cat([h, context], dim=1)))
        return torch.stack(logits, dim=1)


def _s2s_batch(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randint(0, 8000, (n, 60)), torch.randint(0, 8000, (n, 40)), torch.randint(0, 8000, (n, 40))


ho_seq2seq_attention_loop = Workload(
    name="ho_seq2seq_attention_loop", description="GRU encoder + LSTMCell decoder unrolled over 40 steps in Python, "
    "vocab 8000, fp32",
    model=_Seq2SeqAttention, batch=_s2s_batch, forward=lambda m, b: m(b[0], b[1]),
    loss=lambda out, b: F.cross_entropy(out.flatten(0, 1), b[2].flatten()), optimizer=lambda p: torch.optim.Adam(
        p, lr=1e-3), batch_size=128, precision="fp32", tags=("torch", HOLDOUT, "rnn", "python_loop"),
)


class _BiasedAttentionViT(nn.Module):
    """A ViT whose attention carries a learned relative-position bias, passed to SDPA as a float mask."""

    def __init__(self, dim: int = 384, depth: int = 6, heads: int = 6, grid: int = 32) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 8, stride=8)
        self.bias = nn.Parameter(torch.zeros(heads, grid * grid, grid * grid))
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"norm": nn.LayerNorm(dim), "qkv": nn.Linear(dim, 3 * dim), "proj": nn.Linear(dim, dim),
                           "mlp": nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(),
                                                nn.Linear(4 * dim, dim))}) for _ in range(depth))
        self.heads = heads
        self.head = nn.Linear(dim, 100)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        b, n, d = x.shape
        for block in self.blocks:
            q, k, v = block["qkv"](block["norm"](x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias.to(q.dtype))
            x = x + block["proj"](attn.transpose(1, 2).reshape(b, n, d))
            x = x + block["mlp"](x)
        return self.head(x.mean(1))


ho_sdpa_float_bias_vit = Workload(
    name="ho_sdpa_float_bias_vit", description="ViT-S-like, 1024 tokens, learned attention bias as SDPA float mask, "
    "bf16",
    model=_BiasedAttentionViT, batch=images(256, classes=100), loss=ce, optimizer=adamw(), batch_size=16,
    precision="bf16", tags=("torch", HOLDOUT, "transformer", "attention_bias"),
)
