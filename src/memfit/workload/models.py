"""Reference architectures for the built-in zoo, written with torch alone (no downloads, random weights).

They follow the published designs closely enough that their memory behaves like the originals: ResNet-50
(He et al. 2015), ViT-B/16 (Dosovitskiy et al. 2020), a GPT-2-style decoder (Radford et al. 2019), a 2-D U-Net
(Ronneberger et al. 2015) and nnU-Net's default 3-D PlainConvUNet (Isensee et al. 2021: 6 stages, 32..320
features, InstanceNorm, LeakyReLU, deep supervision).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from memfit.workload.chunked_cross_entropy import CausalLMOutput, causal_lm_loss


# --------------------------------------------------------------------------------------------------- ResNet-50
class _Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_ch: int, width: int, stride: int) -> None:
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride, bias=False), nn.BatchNorm2d(out_ch))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, layers: tuple[int, ...] = (3, 4, 6, 3), num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        stages, in_ch = [], 64
        for i, blocks in enumerate(layers):
            width = 64 * 2**i
            stage = []
            for b in range(blocks):
                stage.append(_Bottleneck(in_ch, width, 2 if (b == 0 and i > 0) else 1))
                in_ch = width * _Bottleneck.expansion
            stages.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


# ------------------------------------------------------------------------------------------ transformer blocks
class _SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, causal: bool, dropout: float) -> None:
        super().__init__()
        self.heads, self.causal, self.dropout = heads, causal, dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=self.causal, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int, *, causal: bool, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = _SelfAttention(dim, heads, causal, dropout)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT-2-style decoder: learned positions, pre-norm blocks, tied output embedding."""

    def __init__(
        self,
        vocab: int = 50257,
        seq_len: int = 1024,
        dim: int = 768,
        layers: int = 12,
        heads: int = 12,
        dropout: float = 0.1,
        checkpointing: bool = False,
    ) -> None:
        super().__init__()
        self.checkpointing = checkpointing
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(seq_len, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(TransformerBlock(dim, heads, causal=True, dropout=dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as GPT-2 does

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            # non-reentrant checkpointing: block inputs are kept, everything inside is recomputed in backward
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing and self.training else block(x)
        return self.lm_head(self.ln_f(x))


class CausalLM(nn.Module):
    """A Llama-3-style decoder shaped like a Hugging Face causal LM: an untied output layer over a large
    vocabulary, ``base_model`` returning the last hidden states, ``get_output_embeddings()`` and
    ``forward(input_ids, labels=None)`` returning the shifted loss (so ``Workload.loss_impl="chunked"`` applies)."""

    def __init__(self, vocab: int = 128_256, seq_len: int = 2048, dim: int = 1024, layers: int = 4,
                 heads: int = 16) -> None:
        super().__init__()
        self.model = _DecoderBody(vocab, seq_len, dim, layers, heads)
        self.lm_head = nn.Linear(dim, vocab, bias=False)  # Llama 3 keeps the output layer untied

    @property
    def base_model(self) -> nn.Module:
        return self.model

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> CausalLMOutput:
        logits = self.lm_head(self.model(input_ids))
        return CausalLMOutput(loss=None if labels is None else causal_lm_loss(logits, labels), logits=logits)


class _DecoderBody(nn.Module):
    def __init__(self, vocab: int, seq_len: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.layers = nn.ModuleList(TransformerBlock(dim, heads, causal=True, dropout=0.0) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + self.pos(torch.arange(input_ids.shape[1], device=input_ids.device))
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class ViT(nn.Module):
    """ViT-B/16: 16x16 patches, class token, 12 pre-norm blocks of width 768."""

    def __init__(
        self, image: int = 224, patch: int = 16, dim: int = 768, layers: int = 12, heads: int = 12, classes: int = 1000
    ) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, patch)
        tokens = (image // patch) ** 2 + 1
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, tokens, dim) * 0.02)
        self.blocks = nn.Sequential(*(TransformerBlock(dim, heads, causal=False) for _ in range(layers)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.norm(self.blocks(x))[:, 0])


# ------------------------------------------------------------------------------------------------------ U-Nets
def _conv_block(dims: int, in_ch: int, out_ch: int, stride: int, norm: str) -> nn.Sequential:
    conv = nn.Conv2d if dims == 2 else nn.Conv3d
    if norm == "instance":
        norm_layer: nn.Module = (nn.InstanceNorm2d if dims == 2 else nn.InstanceNorm3d)(out_ch, affine=True, eps=1e-5)
        act: nn.Module = nn.LeakyReLU(0.01, inplace=True)
    else:
        norm_layer = (nn.BatchNorm2d if dims == 2 else nn.BatchNorm3d)(out_ch)
        act = nn.ReLU(inplace=True)
    return nn.Sequential(conv(in_ch, out_ch, 3, stride, 1, bias=norm == "instance"), norm_layer, act)


class UNet(nn.Module):
    """A U-Net with strided-conv downsampling and transposed-conv upsampling (nnU-Net's PlainConvUNet layout).

    Two conv blocks per stage; ``deep_supervision`` returns one logit map per decoder stage (largest first).
    """

    def __init__(
        self,
        dims: int = 3,
        in_channels: int = 4,
        classes: int = 4,
        features: tuple[int, ...] = (32, 64, 128, 256, 320, 320),
        norm: str = "instance",
        deep_supervision: bool = True,
    ) -> None:
        super().__init__()
        convt = nn.ConvTranspose2d if dims == 2 else nn.ConvTranspose3d
        conv = nn.Conv2d if dims == 2 else nn.Conv3d
        self.deep_supervision = deep_supervision
        self.encoder = nn.ModuleList()
        prev = in_channels
        for i, f in enumerate(features):
            self.encoder.append(
                nn.Sequential(_conv_block(dims, prev, f, 1 if i == 0 else 2, norm), _conv_block(dims, f, f, 1, norm))
            )
            prev = f
        self.up = nn.ModuleList()
        self.decoder = nn.ModuleList()
        self.seg = nn.ModuleList()
        for f_skip in reversed(features[:-1]):
            self.up.append(convt(prev, f_skip, 2, 2, bias=False))
            self.decoder.append(
                nn.Sequential(_conv_block(dims, 2 * f_skip, f_skip, 1, norm), _conv_block(dims, f_skip, f_skip, 1, norm))
            )
            self.seg.append(conv(f_skip, classes, 1))
            prev = f_skip

    def forward(self, x: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        skips = []
        for stage in self.encoder:
            x = stage(x)
            skips.append(x)
        x = skips.pop()
        outputs = []
        for up, dec, seg in zip(self.up, self.decoder, self.seg):
            x = dec(torch.cat((up(x), skips.pop()), dim=1))
            if self.deep_supervision or seg is self.seg[-1]:
                outputs.append(seg(x))
        outputs.reverse()  # full resolution first, as nnU-Net does
        return outputs if self.deep_supervision else outputs[0]


def deep_supervision_loss(outputs: list[torch.Tensor] | torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy + soft Dice at every scale, weights halving per scale (nnU-Net's scheme, normalised)."""
    if isinstance(outputs, torch.Tensor):
        outputs = [outputs]
    weights = [1 / 2**i for i in range(len(outputs))]
    if len(weights) > 1:
        weights[-1] = 0.0  # nnU-Net drops the lowest resolution
    total = sum(weights)
    loss = outputs[0].new_zeros(())
    for w, out in zip(weights, outputs):
        if w == 0:
            continue
        t = target if target.shape[2:] == out.shape[2:] else F.interpolate(target[:, None].float(), out.shape[2:]).squeeze(1).long()
        probs = out.float().softmax(1)
        onehot = F.one_hot(t, out.shape[1]).movedim(-1, 1).to(probs.dtype)
        dims = tuple(range(2, out.ndim))
        inter, denom = (probs * onehot).sum(dims), (probs + onehot).sum(dims)
        dice = 1 - ((2 * inter + 1e-5) / (denom + 1e-5)).mean()
        loss = loss + (w / total) * (F.cross_entropy(out, t) + dice)
    return loss


class LSTMLanguageModel(nn.Module):
    """A 2-layer LSTM language model (cuDNN's fused RNN on a GPU)."""

    def __init__(self, vocab: int = 10000, dim: int = 1024, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim, layers, batch_first=True, dropout=0.1)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(idx))
        return self.head(out)


def init_scale(module: nn.Module) -> None:
    """GPT-2's scaled init for residual projections (kept for realism; memory does not depend on it)."""
    for name, p in module.named_parameters():
        if name.endswith("proj.weight"):
            nn.init.normal_(p, std=0.02 / math.sqrt(2 * 12))
