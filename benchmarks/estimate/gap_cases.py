"""The real training steps that issue 13 found 7-18 % off, as workloads (these join the corpus's *fit* half).

Each is the step as the issue measured it; ``memfit estimate benchmarks/estimate/gap_cases.py:NAME`` predicts it
and ``benchmarks/estimate/diagnose_gap.py`` measures it on a GPU with the allocator's event stream.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import memfit


def _smp_unet() -> nn.Module:
    import segmentation_models_pytorch as smp

    return smp.Unet("resnet34", encoder_weights=None, classes=2)


smp_unet_r34_ce2 = memfit.Workload(
    name="smp_unet_r34_ce2",
    model=_smp_unet,
    batch=lambda n: (torch.randn(n, 3, 512, 512), torch.randint(0, 2, (n, 512, 512))),
    loss=lambda out, b: F.cross_entropy(out, b[1]),
    optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
    batch_size=8,
    precision="fp16",
)


def _swin() -> nn.Module:
    from monai.networks.nets import SwinUNETR

    return SwinUNETR(in_channels=1, out_channels=14, feature_size=48)


swin_unetr_ce14 = memfit.Workload(
    name="swin_unetr_ce14",
    model=_swin,
    batch=lambda n: (torch.randn(n, 1, 96, 96, 96), torch.randint(0, 14, (n, 96, 96, 96))),
    loss=lambda out, b: F.cross_entropy(out, b[1]),
    optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
    batch_size=2,
    precision="bf16",
)


class LSTMLanguageModel(nn.Module):
    def __init__(self, vocab: int = 10000, emb: int = 512, hidden: int = 1024, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, emb)
        self.rnn = nn.LSTM(emb, hidden, layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.emb(tokens))
        return self.head(out).flatten(0, 1)  # logits flattened in forward, as the model does


lstm_lm_plain_loop = memfit.Workload(
    name="lstm_lm_plain_loop",
    model=LSTMLanguageModel,
    batch=lambda n: (torch.randint(0, 10000, (n, 256)), torch.randint(0, 10000, (n * 256,))),
    loss=lambda out, b: F.cross_entropy(out, b[1]),
    optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
    batch_size=64,
)


class BiGRUTagger(nn.Module):
    """A long-sequence recurrent model: 3 bidirectional GRU layers over 1000 steps, a per-step classifier."""

    def __init__(self, features: int = 64, hidden: int = 256, layers: int = 3, classes: int = 20) -> None:
        super().__init__()
        self.rnn = nn.GRU(features, hidden, layers, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out)


bigru_1000 = memfit.Workload(
    name="bigru_1000",
    model=BiGRUTagger,
    batch=lambda n: (torch.randn(n, 1000, 64), torch.randint(0, 20, (n, 1000))),
    loss=lambda out, b: F.cross_entropy(out.transpose(1, 2), b[1]),
    optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
    batch_size=32,
)
