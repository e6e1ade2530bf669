"""Plain PyTorch, one feature per entry: RNNs (issue 13's LSTM LM and long bidirectional GRU, packed sequences),
sparse embeddings with SparseAdam, reentrant and non-reentrant checkpointing, ``torch.compile``, a branch on a
tensor's value, boolean-mask and ``.item()`` losses, nn.Transformer, CTC, gradient accumulation, fused optimizers.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipes import ce  # noqa: E402

from memfit import Workload  # noqa: E402

LIBRARY = "torch"


def _adam(p: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(p, lr=1e-3)


# --- RNNs -------------------------------------------------------------------------------------------------------


class LSTMLM(nn.Module):
    """Issue 13's LSTM LM: Embedding 10000x512, LSTM 512->1024 x2, Linear 1024->10000, logits flattened."""

    def __init__(self, vocab: int = 10000) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 512)
        self.lstm = nn.LSTM(512, 1024, num_layers=2, batch_first=True)
        self.head = nn.Linear(1024, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(idx))
        return self.head(out).reshape(-1, self.head.out_features)


def _lm_batch(vocab: int, seq: int) -> Any:
    return lambda n: (torch.randint(0, vocab, (n, seq)), torch.randint(0, vocab, (n * seq,)))


lstm_lm_issue13 = Workload(
    name="lstm_lm_issue13", description="2-layer LSTM LM (512 -> 1024), 10k vocabulary, 64 x 256 tokens, fp32",
    model=LSTMLM, batch=_lm_batch(10000, 256), loss=ce, optimizer=_adam, batch_size=64, precision="fp32",
    tags=("torch", "rnn", "lstm", "issue13"),
)


class FrameGRU(nn.Module):
    """A bidirectional multi-layer GRU tagging every frame of a long sequence (speech frames, sensor data)."""

    def __init__(self, features: int = 80, hidden: int = 512, layers: int = 3, classes: int = 41) -> None:
        super().__init__()
        self.gru = nn.GRU(features, hidden, num_layers=layers, batch_first=True, bidirectional=True, dropout=0.1)
        self.head = nn.Linear(2 * hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x)
        return self.head(out).transpose(1, 2)  # (N, classes, T) for cross_entropy


def _frames(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 1000, 80), torch.randint(0, 41, (n, 1000))


gru_bidir_1000_issue13 = Workload(
    name="gru_bidir_1000_issue13", description="3-layer bidirectional GRU (512) over 1000 frames, fp32",
    model=FrameGRU, batch=_frames, loss=ce, optimizer=_adam, batch_size=32, precision="fp32",
    tags=("torch", "rnn", "gru", "long_sequence", "issue13"),
)
gru_bidir_1000_bf16 = gru_bidir_1000_issue13.replace(name="gru_bidir_1000_bf16", precision="bf16", batch_size=64,
                                                    tags=("torch", "rnn", "gru", "long_sequence"))


class PackedLSTMClassifier(nn.Module):
    """Variable-length sequences through ``pack_padded_sequence`` (lengths as a Python list, as on the CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20000, 300, padding_idx=0)
        self.lstm = nn.LSTM(300, 512, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(1024, 5)

    def forward(self, ids: torch.Tensor, lengths: Any) -> torch.Tensor:
        packed = pack_padded_sequence(self.embed(ids), lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        padded, _ = pad_packed_sequence(out, batch_first=True)
        return self.head(padded.mean(dim=1))


def _packed_batch(n: int) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    lengths = [400 - (37 * i) % 300 for i in range(n)]
    return torch.randint(1, 20000, (n, 400)), lengths, torch.randint(0, 5, (n,))


packed_lstm_lengths_list = Workload(
    name="packed_lstm_lengths_list", description="pack_padded_sequence, lengths a Python list, biLSTM x2",
    model=PackedLSTMClassifier, batch=_packed_batch, forward=lambda m, b: m(b[0], b[1]),
    loss=lambda out, b: F.cross_entropy(out, b[2]), optimizer=_adam, batch_size=64, precision="fp32",
    tags=("torch", "rnn", "lstm", "packed"),
)
packed_lstm_lengths_tensor = packed_lstm_lengths_list.replace(
    name="packed_lstm_lengths_tensor", description="pack_padded_sequence, lengths a device tensor moved to the CPU",
    batch=lambda n: (lambda b: (b[0], torch.tensor(b[1]), b[2]))(_packed_batch(n)),
    forward=lambda m, b: m(b[0], b[1].cpu()),
)


# --- sparse embeddings --------------------------------------------------------------------------------------------


class SkipGram(nn.Module):
    """word2vec skip-gram with negative sampling: two sparse embeddings, nothing dense (SparseAdam's case)."""

    def __init__(self, vocab: int = 500_000, dim: int = 300) -> None:
        super().__init__()
        self.center = nn.Embedding(vocab, dim, sparse=True)
        self.context = nn.Embedding(vocab, dim, sparse=True)

    def forward(self, center: torch.Tensor, context: torch.Tensor, negatives: torch.Tensor) -> torch.Tensor:
        c = self.center(center)  # (N, D)
        pos = (c * self.context(context)).sum(-1)
        neg = torch.bmm(self.context(negatives), c.unsqueeze(-1)).squeeze(-1)  # (N, K)
        return -(F.logsigmoid(pos) + F.logsigmoid(-neg).sum(-1)).mean()


sparse_skipgram_sparseadam = Workload(
    name="sparse_skipgram_sparseadam", description="skip-gram, 500k x 300 sparse embeddings, SparseAdam",
    model=SkipGram,
    batch=lambda n: (torch.randint(0, 500_000, (n,)), torch.randint(0, 500_000, (n,)),
                     torch.randint(0, 500_000, (n, 5))),
    forward=lambda m, b: m(*b), loss=lambda out, b: out, optimizer=lambda p: torch.optim.SparseAdam(list(p), lr=1e-3),
    batch_size=4096, precision="fp32", tags=("torch", "sparse", "embedding"),
)


class SparseRecommender(nn.Module):
    """DLRM-like: sparse EmbeddingBags (sum over a bag of ids) + a dense MLP; SGD takes sparse grads."""

    def __init__(self, tables: int = 8, rows: int = 200_000, dim: int = 64) -> None:
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum", sparse=True) for _ in range(tables))
        self.mlp = nn.Sequential(nn.Linear(tables * dim + 13, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                                 nn.Linear(256, 1))

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        pooled = [bag(ids[:, i]) for i, bag in enumerate(self.bags)]  # ids (N, tables, bag)
        return self.mlp(torch.cat([dense, *pooled], dim=1)).squeeze(-1)


sparse_embeddingbag_sgd = Workload(
    name="sparse_embeddingbag_sgd", description="8 sparse EmbeddingBags (200k x 64) + MLP, SGD",
    model=SparseRecommender,
    batch=lambda n: (torch.randn(n, 13), torch.randint(0, 200_000, (n, 8, 20)), torch.rand(n)),
    forward=lambda m, b: m(b[0], b[1]), loss=lambda out, b: F.binary_cross_entropy_with_logits(out, b[2]),
    optimizer=lambda p: torch.optim.SGD(p, lr=0.01), batch_size=2048, precision="fp32",
    tags=("torch", "sparse", "embedding"),
)


# --- checkpointing, compile, control flow ---------------------------------------------------------------------------


class Encoder(nn.Module):
    """nn.TransformerEncoderLayer x N; ``reentrant`` runs each layer under torch.utils.checkpoint."""

    def __init__(self, layers: int = 8, dim: int = 768, reentrant: bool | None = None, vocab: int = 32000) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, 12, 4 * dim, dropout=0.1, batch_first=True, norm_first=True,
                                       activation="gelu") for _ in range(layers))
        self.head = nn.Linear(dim, vocab)
        self.reentrant = reentrant

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            if self.reentrant is None:
                x = layer(x)
            else:
                x = checkpoint(layer, x, use_reentrant=self.reentrant)
        return self.head(x).flatten(0, 1)


def _mlm_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 32000, (n, 512)), torch.randint(0, 32000, (n * 512,))


checkpoint_reentrant = Workload(
    name="checkpoint_reentrant", description="8 TransformerEncoderLayers, each under reentrant checkpoint",
    model=lambda: Encoder(reentrant=True), batch=_mlm_batch, loss=ce, optimizer=_adam, batch_size=16,
    precision="bf16", tags=("torch", "transformer", "checkpointing", "reentrant"),
)
checkpoint_nonreentrant = checkpoint_reentrant.replace(
    name="checkpoint_nonreentrant", description="the same, use_reentrant=False",
    model=lambda: Encoder(reentrant=False), tags=("torch", "transformer", "checkpointing"),
)
checkpoint_memfit_knob = checkpoint_reentrant.replace(
    name="checkpoint_memfit_knob", description="the same, checkpointed by Workload.checkpoint",
    model=Encoder, checkpoint=tuple(f"layers.{i}" for i in range(8)), tags=("torch", "transformer", "checkpointing"),
)
transformer_encoder_plain = checkpoint_reentrant.replace(
    name="transformer_encoder_plain", description="8 TransformerEncoderLayers, no checkpointing", model=Encoder,
    tags=("torch", "transformer"),
)
compiled_encoder = checkpoint_reentrant.replace(
    name="compiled_encoder", description="the same encoder under torch.compile(model)",
    model=lambda: torch.compile(Encoder()), tags=("torch", "transformer", "compile"),
)


class GatedNet(nn.Module):
    """A forward that branches on a tensor's value (``if x.abs().sum() > 0``), as input checks in user code do."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024))
        self.b = nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1024))
        self.head = nn.Linear(1024, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.abs().sum() > 0:  # true for real data: the big branch runs
            x = self.a(x)
        else:
            x = self.b(x)
        return self.head(x)


value_dependent_branch = Workload(
    name="value_dependent_branch", description="forward branches on x.abs().sum() > 0 (big branch when true)",
    model=GatedNet, batch=lambda n: (torch.randn(n, 1024), torch.randint(0, 1000, (n,))), loss=ce,
    optimizer=_adam, batch_size=4096, precision="fp32", tags=("torch", "mlp", "value_dependent"),
)


def _masked_lm_loss(out: torch.Tensor, batch: Any) -> torch.Tensor:
    # only the masked positions count: boolean indexing, whose size depends on the labels' values
    labels = batch[1]
    keep = labels != -100
    return F.cross_entropy(out[keep], labels[keep])


def _masked_labels(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 32000, (n, 512))
    labels = torch.where(torch.rand(n * 512) < 0.15, ids.flatten(), torch.full((n * 512,), -100))
    return ids, labels


boolean_mask_loss = transformer_encoder_plain.replace(
    name="boolean_mask_loss", description="encoder, loss over masked positions picked by a boolean mask",
    batch=_masked_labels, loss=_masked_lm_loss, tags=("torch", "transformer", "data_dependent"),
)


def _item_normalised_loss(out: torch.Tensor, batch: Any) -> torch.Tensor:
    labels = batch[1]
    tokens = int((labels != -100).sum().item())  # a host sync; fake tensors have no value to read
    return F.cross_entropy(out, labels, ignore_index=-100, reduction="sum") / max(tokens, 1)


item_normalised_loss = boolean_mask_loss.replace(
    name="item_normalised_loss", description="encoder, loss divided by a token count read with .item()",
    loss=_item_normalised_loss, tags=("torch", "transformer", "item"),
)


# --- other layers and loops ---------------------------------------------------------------------------------------


def _seq2seq() -> nn.Module:
    class Seq2Seq(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(37000, 512)
            self.t = nn.Transformer(512, 8, 6, 6, 2048, dropout=0.1, batch_first=True)
            self.head = nn.Linear(512, 37000)

        def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
            mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device)
            out = self.t(self.embed(src), self.embed(tgt), tgt_mask=mask, tgt_is_causal=True)
            return self.head(out).transpose(1, 2)

    return Seq2Seq()


nn_transformer_seq2seq = Workload(
    name="nn_transformer_seq2seq", description="nn.Transformer base (6+6 layers, 512), 37k vocab, 128 tokens",
    model=_seq2seq,
    batch=lambda n: (torch.randint(0, 37000, (n, 128)), torch.randint(0, 37000, (n, 128))),
    forward=lambda m, b: m(b[0], b[1]), loss=lambda out, b: F.cross_entropy(out, b[1], label_smoothing=0.1),
    optimizer=lambda p: torch.optim.Adam(p, lr=1e-4, betas=(0.9, 0.98)), batch_size=64, precision="fp16",
    tags=("torch", "transformer", "encoder_decoder"),
)


class ConvCTC(nn.Module):
    """Conv front end + biLSTM + CTC head over 80-bin features (a DeepSpeech-like acoustic model)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv1d(80, 256, 11, stride=2, padding=5), nn.BatchNorm1d(256), nn.ReLU(),
                                  nn.Conv1d(256, 256, 11, padding=5), nn.BatchNorm1d(256), nn.ReLU())
        self.rnn = nn.LSTM(256, 512, num_layers=3, batch_first=True, bidirectional=True)
        self.head = nn.Linear(1024, 29)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.conv(x).transpose(1, 2))
        return self.head(h).log_softmax(-1).transpose(0, 1)  # (T, N, C) as ctc_loss wants


def _ctc_loss(out: torch.Tensor, batch: Any) -> torch.Tensor:
    t, n = out.shape[:2]
    targets = batch[1]
    input_lengths = torch.full((n,), t, dtype=torch.long)
    target_lengths = torch.full((n,), targets.shape[1], dtype=torch.long)
    return F.ctc_loss(out, targets, input_lengths, target_lengths)


conv_lstm_ctc = Workload(
    name="conv_lstm_ctc", description="conv + 3-layer biLSTM acoustic model, CTC, 1200 frames, 29 characters",
    model=ConvCTC, batch=lambda n: (torch.randn(n, 80, 1200), torch.randint(1, 29, (n, 150))), loss=_ctc_loss,
    optimizer=_adam, batch_size=32, precision="fp32", tags=("torch", "rnn", "lstm", "ctc", "speech"),
)


def _tcn() -> nn.Module:
    layers: list[nn.Module] = [nn.Conv1d(64, 256, 1)]
    for i in range(10):
        layers += [nn.Conv1d(256, 256, 3, padding=2**i, dilation=2**i), nn.GroupNorm(8, 256), nn.GELU()]
    return nn.Sequential(*layers, nn.Conv1d(256, 10, 1))


tcn_dilated_fp16 = Workload(
    name="tcn_dilated_fp16", description="10 dilated Conv1d blocks over 16384 steps, per-step 10 classes, fp16",
    model=_tcn, batch=lambda n: (torch.randn(n, 64, 16384), torch.randint(0, 10, (n, 16384))), loss=ce,
    optimizer=_adam, batch_size=16, precision="fp16", tags=("torch", "cnn", "1d"),
)


class VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, 64, 4, 2, 1), nn.SiLU(), nn.Conv2d(64, 128, 4, 2, 1), nn.SiLU(),
                                 nn.Conv2d(128, 256, 4, 2, 1), nn.SiLU(), nn.Conv2d(256, 2 * 64, 1))
        self.dec = nn.Sequential(nn.ConvTranspose2d(64, 256, 4, 2, 1), nn.SiLU(),
                                 nn.ConvTranspose2d(256, 128, 4, 2, 1), nn.SiLU(),
                                 nn.ConvTranspose2d(128, 3, 4, 2, 1))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mu, logvar = self.enc(x).chunk(2, dim=1)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()  # reparameterisation
        return self.dec(z), mu, logvar


def _vae_loss(out: Any, batch: Any) -> torch.Tensor:
    recon, mu, logvar = out
    kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).mean()
    return F.mse_loss(recon, batch) + 1e-3 * kl


conv_vae = Workload(
    name="conv_vae", description="convolutional VAE, 256x256 RGB, MSE + KL", model=VAE,
    batch=lambda n: torch.randn(n, 3, 256, 256), forward=lambda m, b: m(b), loss=_vae_loss,
    optimizer=lambda p: torch.optim.AdamW(p, lr=2e-4), batch_size=32, precision="bf16",
    tags=("torch", "cnn", "generative"),
)


class DenseMoE(nn.Module):
    """Top-2 mixture of experts with dense dispatch (every expert sees every token, gates zero the rest)."""

    def __init__(self, dim: int = 512, experts: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(32000, dim)
        self.gate = nn.Linear(dim, experts)
        self.w1 = nn.Parameter(torch.randn(experts, dim, 4 * dim) * 0.02)
        self.w2 = nn.Parameter(torch.randn(experts, 4 * dim, dim) * 0.02)
        self.head = nn.Linear(dim, 32000)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        scores = self.gate(x).softmax(-1)
        top, idx = scores.topk(2, dim=-1)
        gates = torch.zeros_like(scores).scatter(-1, idx, top)  # (N, T, E)
        h = torch.einsum("ntd,edf->ntef", x, self.w1).relu()
        y = torch.einsum("ntef,efd->nted", h, self.w2)
        return self.head(x + (gates.unsqueeze(-1) * y).sum(2)).flatten(0, 1)


moe_dense_dispatch = Workload(
    name="moe_dense_dispatch", description="8-expert top-2 MoE layer, dense dispatch, 256 tokens",
    model=DenseMoE, batch=lambda n: (torch.randint(0, 32000, (n, 256)), torch.randint(0, 32000, (n * 256,))),
    loss=ce, optimizer=lambda p: torch.optim.AdamW(p, lr=3e-4), batch_size=16, precision="bf16",
    tags=("torch", "moe"),
)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(2048, 8192), nn.ReLU(inplace=True), nn.Dropout(0.1), nn.Linear(8192, 8192),
                         nn.ReLU(inplace=True), nn.Linear(8192, 1001))


mlp_fused_adamw = Workload(
    name="mlp_fused_adamw", description="3-layer MLP (8192 wide), 1001 classes, fused AdamW", model=_mlp,
    batch=lambda n: (torch.randn(n, 2048), torch.randint(0, 1001, (n,))), loss=ce,
    optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), optimizer_impl="fused", batch_size=1024,
    precision="bf16", tags=("torch", "mlp", "fused_optimizer"),
)
mlp_forloop_sgd_accum4 = mlp_fused_adamw.replace(
    name="mlp_forloop_sgd_accum4", description="the MLP, for-loop SGD momentum, 4 accumulated micro-batches",
    optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), optimizer_impl="for-loop",
    accumulation_steps=4, batch_size=256, precision="fp32", tags=("torch", "mlp", "accumulation"),
)


class EmbedMaxNorm(nn.Module):
    """``nn.Embedding(max_norm=1)`` renormalises the looked-up rows in place during forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100_000, 256, max_norm=1.0)
        self.head = nn.Linear(256, 100)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids).mean(1))


embedding_max_norm = Workload(
    name="embedding_max_norm", description="Embedding(max_norm=1.0) bag-of-words classifier", model=EmbedMaxNorm,
    batch=lambda n: (torch.randint(0, 100_000, (n, 128)), torch.randint(0, 100, (n,))), loss=ce, optimizer=_adam,
    batch_size=512, precision="fp32", tags=("torch", "embedding"),
)


def _unet3d_gn() -> nn.Module:
    def block(i: int, o: int) -> nn.Module:
        return nn.Sequential(nn.Conv3d(i, o, 3, padding=1), nn.GroupNorm(8, o), nn.SiLU(),
                             nn.Conv3d(o, o, 3, padding=1), nn.GroupNorm(8, o), nn.SiLU())

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.d1, self.d2, self.d3 = block(1, 32), block(32, 64), block(64, 128)
            self.u2, self.u1 = block(128 + 64, 64), block(64 + 32, 32)
            self.out = nn.Conv3d(32, 5, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = self.d1(x)
            b = self.d2(F.max_pool3d(a, 2))
            c = self.d3(F.max_pool3d(b, 2))
            b = self.u2(torch.cat([F.interpolate(c, scale_factor=2, mode="trilinear"), b], 1))
            return self.out(self.u1(torch.cat([F.interpolate(b, scale_factor=2, mode="trilinear"), a], 1)))

    return Net()


unet3d_groupnorm_interp = Workload(
    name="unet3d_groupnorm_interp", description="3-level 3-D U-Net, GroupNorm, trilinear upsampling, 96^3",
    model=_unet3d_gn, batch=lambda n: (torch.randn(n, 1, 96, 96, 96), torch.randint(0, 5, (n, 96, 96, 96))),
    loss=ce, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4), batch_size=2, precision="bf16",
    tags=("torch", "cnn", "segmentation", "3d"),
)


# --- one plain-torch step per failure class that library entries hit (tests/test_zoo_subset.py uses them) ----------


class FrozenEmbeddingClassifier(nn.Module):
    """A frozen embedding table (``requires_grad=False``, as pretrained vectors are) under a trainable head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50_000, 300)
        self.embed.weight.requires_grad_(False)
        self.head = nn.Sequential(nn.Linear(300, 1024), nn.ReLU(), nn.Linear(1024, 20))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids).mean(1))


frozen_embedding_head = Workload(
    name="frozen_embedding_head", description="frozen 50k x 300 embedding, trainable 2-layer head",
    model=FrozenEmbeddingClassifier, batch=lambda n: (torch.randint(0, 50_000, (n, 256)), torch.randint(0, 20, (n,))),
    loss=ce, optimizer=_adam, batch_size=256, precision="fp32", tags=("torch", "frozen", "embedding"),
)


def _dice_over_tensor_dims(out: torch.Tensor, batch: Any) -> torch.Tensor:
    # MONAI's DiceLoss takes its reduction dims from a tensor: torch.arange(2, ndim).tolist()
    dims = torch.arange(2, out.ndim).tolist()
    probs = out.float().softmax(1)
    onehot = F.one_hot(batch[1], out.shape[1]).movedim(-1, 1).to(probs.dtype)
    inter, denom = (probs * onehot).sum(dims), (probs + onehot).sum(dims)
    return 1 - (2 * inter / denom.clamp_min(1e-5)).mean()


dice_dims_from_tensor = Workload(
    name="dice_dims_from_tensor", description="3-D U-Net, Dice whose dims come from arange(...).tolist()",
    model=_unet3d_gn, batch=lambda n: (torch.randn(n, 1, 64, 64, 64), torch.randint(0, 5, (n, 64, 64, 64))),
    loss=_dice_over_tensor_dims, optimizer=_adam, batch_size=2, precision="fp32",
    tags=("torch", "cnn", "segmentation", "3d", "item"),
)


class GroupedExperts(nn.Module):
    """MoE experts through ``torch._grouped_mm`` as transformers 5 runs them, fp32 weights under bf16 autocast."""

    def __init__(self, experts: int = 8, dim: int = 512) -> None:
        super().__init__()
        self.embed = nn.Embedding(32000, dim)
        self.w = nn.Parameter(torch.randn(experts, dim, dim) * 0.02)
        self.head = nn.Linear(dim, 32000)
        self.experts = experts

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids).flatten(0, 1)  # tokens sorted by expert, equal groups
        per = x.shape[0] // self.experts
        offs = torch.arange(1, self.experts + 1, dtype=torch.int32, device=x.device) * per
        y = torch._grouped_mm(x.to(self.w.dtype), self.w, offs=offs)
        return self.head(y)


grouped_mm_experts = Workload(
    name="grouped_mm_experts", description="8 experts through torch._grouped_mm, fp32 weights, bf16 autocast",
    model=GroupedExperts, batch=lambda n: (torch.randint(0, 32000, (n, 256)), torch.randint(0, 32000, (n * 256,))),
    loss=ce, optimizer=_adam, batch_size=8, precision="bf16", tags=("torch", "moe"),
)


def _moved_after_build() -> nn.Module:
    # peft builds its adapters, then moves them to the base layer's device with .to(): the same call here
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    return model.to(next(model.parameters()).device)


module_to_after_build = Workload(
    name="module_to_after_build", description="MLP moved with .to(its own device) in its factory, as peft does",
    model=_moved_after_build, batch=lambda n: (torch.randn(n, 1024), torch.randint(0, 10, (n,))), loss=ce,
    optimizer=_adam, batch_size=256, precision="fp32", tags=("torch", "mlp"),
)
