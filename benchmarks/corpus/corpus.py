"""The validation corpus as workloads: ``memfit estimate benchmarks/corpus/corpus.py:c042_hf_lm``.

``corpus.json`` (written by ``generate.py`` with a fixed seed, before any fitting) holds one configuration per
entry: a family, its parameters, precision, optimizer and implementation, batch size and loop (``keep_output``).
This module turns a configuration into a ``memfit.Workload``; the module-level ``__getattr__`` makes every entry id
an attribute, so memfit's ``file.py:NAME`` loader finds it. Model libraries are imported when the model is built:
torch, torchvision, timm, transformers and peft — what the GPU machine has.

    from corpus import entries, workload      # or load_workload("benchmarks/corpus/corpus.py:ID")
    w = workload("c000_tv_cls")
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memfit import Workload

CORPUS_JSON = Path(__file__).resolve().parent / "corpus.json"

Params = dict[str, Any]


@cache
def _corpus() -> dict[str, Any]:
    return json.loads(CORPUS_JSON.read_text())


def entries(split: str | None = None) -> list[dict[str, Any]]:
    """The corpus's configurations (``split``: ``fit`` or ``validation`` for one half)."""
    return [e for e in _corpus()["entries"] if split is None or e["split"] == split]


# --- losses -------------------------------------------------------------------------------------------------------


def _dice(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Soft Dice over classes (softmax, one-hot target), as MONAI's DiceLoss(to_onehot_y, softmax) computes it."""
    probs = logits.float().softmax(1)
    onehot = F.one_hot(target, logits.shape[1]).movedim(-1, 1).to(probs.dtype)
    dims = tuple(range(2, logits.ndim))
    inter, denom = (probs * onehot).sum(dims), (probs + onehot).sum(dims)
    return 1 - ((2 * inter + 1e-5) / (denom + 1e-5)).mean()


def _dense_loss(kind: str) -> Callable[[Any, Any], torch.Tensor]:
    """Per-pixel/voxel losses: ``ce``, ``dice``, ``dice_ce`` or ``deep_supervision`` (a list of outputs)."""
    def loss(out: Any, batch: Any) -> torch.Tensor:
        target = batch[1]
        if kind == "deep_supervision":
            from memfit.workload.models import deep_supervision_loss

            return deep_supervision_loss(out, target)
        if isinstance(out, dict):  # torchvision segmentation: main head (+ aux head at half weight)
            main = out["out"]
            extra = 0.5 * F.cross_entropy(out["aux"], target) if "aux" in out else 0.0
        else:
            main, extra = out, 0.0
        if kind == "ce":
            return F.cross_entropy(main, target) + extra
        if kind == "dice":
            return _dice(main, target) + extra
        return F.cross_entropy(main, target) + _dice(main, target) + extra

    return loss


def _ce(out: Any, batch: Any) -> torch.Tensor:
    return F.cross_entropy(out, batch[1])


def _hf_loss(out: Any, batch: Any) -> torch.Tensor:
    return out.loss


# --- families: each returns the Workload fields it decides ----------------------------------------------------------


def _tv_cls(p: Params) -> dict[str, Any]:
    def model() -> nn.Module:
        import torchvision

        return torchvision.models.get_model(p["arch"], weights=None, num_classes=p["classes"])

    size, classes = p["size"], p["classes"]
    return dict(model=model, batch=lambda n: (torch.randn(n, 3, size, size), torch.randint(0, classes, (n,))),
                loss=_ce, channels_last=p.get("channels_last", False))


def _timm_cls(p: Params) -> dict[str, Any]:
    def model() -> nn.Module:
        import timm

        kwargs = {"img_size": p["size"]} if p.get("pass_img_size") else {}
        return timm.create_model(p["arch"], pretrained=False, num_classes=p["classes"],
                                 drop_path_rate=p.get("drop_path", 0.0), **kwargs)

    size, classes = p["size"], p["classes"]
    return dict(model=model, batch=lambda n: (torch.randn(n, 3, size, size), torch.randint(0, classes, (n,))),
                loss=_ce)


def _tv_seg(p: Params) -> dict[str, Any]:
    def model() -> nn.Module:
        import torchvision

        aux = {"aux_loss": True} if p.get("aux") else {}
        return torchvision.models.get_model(p["arch"], weights=None, weights_backbone=None,
                                            num_classes=p["classes"], **aux)

    size, classes = p["size"], p["classes"]
    return dict(model=model, batch=lambda n: (torch.randn(n, 3, size, size), torch.randint(0, classes, (n, size, size))),
                loss=_dense_loss(p["loss"]))


def _unet(p: Params) -> dict[str, Any]:
    from memfit.workload.models import UNet

    dims, size, classes, ch = p["dims"], p["size"], p["classes"], p["in_channels"]
    deep = p["loss"] == "deep_supervision"
    return dict(
        model=lambda: UNet(dims=dims, in_channels=ch, classes=classes, features=tuple(p["features"]),
                           norm=p["norm"], deep_supervision=deep),
        batch=lambda n: (torch.randn(n, ch, *([size] * dims)), torch.randint(0, classes, (n, *([size] * dims)))),
        loss=_dense_loss(p["loss"]),
    )


_HF_LM = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Config"),
    "llama": ("LlamaForCausalLM", "LlamaConfig"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
    "mistral": ("MistralForCausalLM", "MistralConfig"),
    "phi": ("PhiForCausalLM", "PhiConfig"),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig"),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig"),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig"),
}


def _lm_config(p: Params) -> tuple[str, Any]:
    import transformers

    model_cls, config_cls = _HF_LM[p["arch"]]
    h, layers, heads, vocab = p["hidden"], p["layers"], p["heads"], p["vocab"]
    if p["arch"] == "gpt2":
        cfg: dict[str, Any] = dict(vocab_size=vocab, n_embd=h, n_layer=layers, n_head=heads, bos_token_id=0, eos_token_id=0,
                                   n_positions=max(1024, p["seq"]))
    else:
        cfg = dict(vocab_size=vocab, hidden_size=h, intermediate_size=p["ffn"], num_hidden_layers=layers,
                   num_attention_heads=heads, max_position_embeddings=max(2048, p["seq"]))
        if p["arch"] != "phi":
            cfg["num_key_value_heads"] = p.get("kv_heads", heads)
        if p["arch"] == "mixtral":
            cfg.update(num_local_experts=p["experts"], num_experts_per_tok=p["top_k"], output_router_logits=True)
        elif p["arch"] == "qwen2_moe":
            cfg.update(num_experts=p["experts"], num_experts_per_tok=p["top_k"], moe_intermediate_size=p["ffn"],
                       shared_expert_intermediate_size=2 * p["ffn"], output_router_logits=True)
        elif p["arch"] == "olmoe":
            cfg.update(num_experts=p["experts"], num_experts_per_tok=p["top_k"])
    if "tie" in p:
        cfg["tie_word_embeddings"] = p["tie"]
    return model_cls, getattr(transformers, config_cls)(**cfg)


def _hf_lm(p: Params) -> dict[str, Any]:
    def model() -> nn.Module:
        import transformers

        model_cls, config = _lm_config(p)
        m = getattr(transformers, model_cls)(config)
        if p.get("checkpointing"):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if p.get("lora_r"):
            from peft import LoraConfig, get_peft_model

            m = get_peft_model(m, LoraConfig(r=p["lora_r"], lora_alpha=2 * p["lora_r"], lora_dropout=0.05,
                                             target_modules=p["lora_targets"], task_type="CAUSAL_LM"))
        return m

    vocab, seq = p["vocab"], p["seq"]
    return dict(model=model, batch=lambda n: torch.randint(0, vocab, (n, seq)),
                forward=lambda m, b: m(input_ids=b, labels=b), loss=_hf_loss)


_HF_ENCODER = {
    "bert": ("BertConfig", "BertForSequenceClassification", "BertForMaskedLM"),
    "roberta": ("RobertaConfig", "RobertaForSequenceClassification", "RobertaForMaskedLM"),
    "distilbert": ("DistilBertConfig", "DistilBertForSequenceClassification", "DistilBertForMaskedLM"),
    "deberta_v2": ("DebertaV2Config", "DebertaV2ForSequenceClassification", "DebertaV2ForMaskedLM"),
}


def _hf_encoder(p: Params) -> dict[str, Any]:
    def model() -> nn.Module:
        import transformers

        config_cls, cls_model, mlm_model = _HF_ENCODER[p["arch"]]
        h, layers, heads = p["hidden"], p["layers"], p["heads"]
        if p["arch"] == "distilbert":
            cfg: dict[str, Any] = dict(dim=h, n_layers=layers, n_heads=heads, hidden_dim=4 * h)
        else:
            cfg = dict(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=4 * h)
        cfg.update(vocab_size=p["vocab"], num_labels=p["classes"], max_position_embeddings=max(514, p["seq"] + 2))
        m = getattr(transformers, mlm_model if p["task"] == "mlm" else cls_model)(
            getattr(transformers, config_cls)(**cfg))
        if p.get("freeze_layers"):
            base = getattr(m, m.base_model_prefix)
            for prm in base.embeddings.parameters():
                prm.requires_grad_(False)
            blocks = base.transformer.layer if p["arch"] == "distilbert" else base.encoder.layer
            for block in blocks[: p["freeze_layers"]]:
                for prm in block.parameters():
                    prm.requires_grad_(False)
        return m

    vocab, seq, classes, task = p["vocab"], p["seq"], p["classes"], p["task"]

    def batch(n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, vocab, (n, seq))
        labels = ids.clone() if task == "mlm" else torch.randint(0, classes, (n,))
        return {"input_ids": ids, "attention_mask": torch.ones(n, seq, dtype=torch.long), "labels": labels}

    return dict(model=model, batch=batch, loss=_hf_loss)


def _hf_seq2seq(p: Params) -> dict[str, Any]:
    def model() -> nn.Module:
        import transformers

        d, layers, heads, vocab = p["d_model"], p["layers"], p["heads"], p["vocab"]
        if p["arch"] == "t5":
            cfg = transformers.T5Config(d_model=d, d_ff=4 * d, d_kv=d // heads, num_layers=layers, num_heads=heads,
                                        vocab_size=vocab, decoder_start_token_id=0, pad_token_id=0)
            return transformers.T5ForConditionalGeneration(cfg)
        if p["arch"] == "whisper":
            cfg = transformers.WhisperConfig(vocab_size=vocab, d_model=d, encoder_layers=layers, decoder_layers=layers,
                                             encoder_attention_heads=heads, decoder_attention_heads=heads,
                                             encoder_ffn_dim=4 * d, decoder_ffn_dim=4 * d, num_mel_bins=80)
            return transformers.WhisperForConditionalGeneration(cfg)
        cfg = transformers.BartConfig(vocab_size=vocab, d_model=d, encoder_layers=layers, decoder_layers=layers,
                                      encoder_attention_heads=heads, decoder_attention_heads=heads,
                                      encoder_ffn_dim=4 * d, decoder_ffn_dim=4 * d)
        return transformers.BartForConditionalGeneration(cfg)

    vocab, src, tgt = p["vocab"], p["src"], p["tgt"]
    if p["arch"] == "whisper":
        def batch(n: int) -> dict[str, torch.Tensor]:
            return {"input_features": torch.randn(n, 80, 3000), "labels": torch.randint(0, vocab, (n, tgt))}
    else:
        def batch(n: int) -> dict[str, torch.Tensor]:
            return {"input_ids": torch.randint(0, vocab, (n, src)), "labels": torch.randint(0, vocab, (n, tgt))}
    return dict(model=model, batch=batch, loss=_hf_loss)


def _hf_vision(p: Params) -> dict[str, Any]:
    def model() -> nn.Module:
        import transformers

        config_cls, model_cls = {"vit": ("ViTConfig", "ViTForImageClassification"),
                                 "swin": ("SwinConfig", "SwinForImageClassification"),
                                 "convnext": ("ConvNextConfig", "ConvNextForImageClassification")}[p["arch"]]
        return getattr(transformers, model_cls)(getattr(transformers, config_cls)(num_labels=p["classes"]))

    size, classes = p["size"], p["classes"]
    return dict(model=model, loss=_hf_loss, batch=lambda n: {
        "pixel_values": torch.randn(n, 3, size, size), "labels": torch.randint(0, classes, (n,))})


class _RNNNet(nn.Module):
    """LSTM/GRU language model (``lm``: logits flattened) or frame tagger (``tagger``: (N, C, T) logits)."""

    def __init__(self, p: Params) -> None:
        super().__init__()
        self.task = p["task"]
        cell = nn.LSTM if p["cell"] == "lstm" else nn.GRU
        inp = p["embed"] if self.task == "lm" else p["features"]
        self.embed = nn.Embedding(p["vocab"], p["embed"]) if self.task == "lm" else None
        self.rnn = cell(inp, p["hidden"], num_layers=p["layers"], batch_first=True,
                        bidirectional=p.get("bidirectional", False), dropout=0.1 if p["layers"] > 1 else 0.0)
        out = p["hidden"] * (2 if p.get("bidirectional") else 1)
        self.head = nn.Linear(out, p["vocab"] if self.task == "lm" else p["classes"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.embed(x) if self.embed is not None else x)
        logits = self.head(h)
        return logits.flatten(0, 1) if self.task == "lm" else logits.transpose(1, 2)


def _rnn(p: Params) -> dict[str, Any]:
    seq = p["seq"]
    if p["task"] == "lm":
        vocab = p["vocab"]
        batch = lambda n: (torch.randint(0, vocab, (n, seq)), torch.randint(0, vocab, (n * seq,)))  # noqa: E731
    else:
        feats, classes = p["features"], p["classes"]
        batch = lambda n: (torch.randn(n, seq, feats), torch.randint(0, classes, (n, seq)))  # noqa: E731
    return dict(model=lambda: _RNNNet(p), batch=batch, loss=_ce)


def _detection(p: Params) -> dict[str, Any]:
    def model() -> nn.Module:
        import torchvision

        return torchvision.models.get_model(p["arch"], weights=None, weights_backbone=None,
                                            num_classes=p["classes"])

    size, objects, classes = p["size"], p["objects"], p["classes"]

    def batch(n: int) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
        imgs, targets = [], []
        for _ in range(n):
            xy = torch.rand(objects, 2) * (size / 2)
            wh = torch.rand(objects, 2) * (size / 4) + 16
            targets.append({"boxes": torch.cat([xy, xy + wh], 1), "labels": torch.randint(1, classes, (objects,))})
            imgs.append(torch.rand(3, size, size))
        return imgs, targets

    return dict(model=model, batch=batch, forward=lambda m, b: m(b[0], b[1]),
                loss=lambda out, b: sum(out.values()))


def _frozen_cnn(p: Params) -> dict[str, Any]:
    def model() -> nn.Module:
        import torchvision

        m = torchvision.models.get_model(p["arch"], weights=None, num_classes=p["classes"])
        head = p["head"]
        for name, prm in m.named_parameters():
            prm.requires_grad_(any(name.startswith(h) for h in head))
        return m

    size, classes = p["size"], p["classes"]
    return dict(model=model, batch=lambda n: (torch.randn(n, 3, size, size), torch.randint(0, classes, (n,))),
                loss=_ce)


class _Encoder(nn.Module):
    def __init__(self, p: Params) -> None:
        super().__init__()
        d = p["dim"]
        self.embed = nn.Embedding(p["vocab"], d)
        layer = nn.TransformerEncoderLayer(d, p["heads"], 4 * d, dropout=0.1, batch_first=True,
                                           norm_first=p["norm_first"], activation="gelu")
        self.encoder = nn.TransformerEncoder(layer, p["layers"], enable_nested_tensor=False)
        self.head = nn.Linear(d, p["vocab"])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids))).flatten(0, 1)


def _torch_encoder(p: Params) -> dict[str, Any]:
    vocab, seq = p["vocab"], p["seq"]
    ckpt = tuple(f"encoder.layers.{i}" for i in range(p["layers"])) if p.get("checkpoint") else ()
    return dict(model=lambda: _Encoder(p), checkpoint=ckpt, loss=_ce,
                batch=lambda n: (torch.randint(0, vocab, (n, seq)), torch.randint(0, vocab, (n * seq,))))


def _mlp(p: Params) -> dict[str, Any]:
    widths, classes = p["widths"], p["classes"]

    def model() -> nn.Module:
        layers: list[nn.Module] = []
        for a, b in zip(widths[:-1], widths[1:]):
            layers += [nn.Linear(a, b), nn.GELU(), nn.Dropout(0.1)]
        return nn.Sequential(*layers, nn.Linear(widths[-1], classes))

    return dict(model=model, loss=_ce,
                batch=lambda n: (torch.randn(n, widths[0]), torch.randint(0, classes, (n,))))


class _SparseBag(nn.Module):
    def __init__(self, p: Params) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(p["rows"], p["dim"], mode="mean", sparse=True)
        self.head = nn.Linear(p["dim"], p["classes"]) if p["dense_head"] else None
        self.classes = p["classes"]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pooled = self.bag(ids)
        return self.head(pooled) if self.head is not None else pooled[:, : self.classes]


def _sparse_embedding(p: Params) -> dict[str, Any]:
    rows, bag, classes = p["rows"], p["bag"], p["classes"]
    return dict(model=lambda: _SparseBag(p), loss=_ce,
                batch=lambda n: (torch.randint(0, rows, (n, bag)), torch.randint(0, classes, (n,))))


FAMILIES: dict[str, Callable[[Params], dict[str, Any]]] = {
    "tv_cls": _tv_cls, "timm_cls": _timm_cls, "tv_seg": _tv_seg, "unet": _unet, "hf_lm": _hf_lm,
    "hf_moe": _hf_lm, "hf_lora": _hf_lm, "hf_encoder": _hf_encoder, "hf_seq2seq": _hf_seq2seq,
    "hf_vision": _hf_vision, "rnn": _rnn, "detection": _detection, "frozen_cnn": _frozen_cnn,
    "torch_encoder": _torch_encoder, "mlp": _mlp, "sparse_embedding": _sparse_embedding,
}

REQUIRES = {"tv_cls": ("torchvision",), "timm_cls": ("timm",), "tv_seg": ("torchvision",),
            "hf_lm": ("transformers",), "hf_moe": ("transformers",), "hf_lora": ("transformers", "peft"),
            "hf_encoder": ("transformers",), "hf_seq2seq": ("transformers",), "hf_vision": ("transformers",),
            "detection": ("torchvision",), "frozen_cnn": ("torchvision",)}
"""Libraries (import names) each family needs beside torch."""


def _optimizer(spec: dict[str, Any]) -> Callable[[Any], torch.optim.Optimizer]:
    name, lr, wd = spec["name"], spec["lr"], spec.get("weight_decay", 0.0)
    if name == "SGD":
        return lambda p: torch.optim.SGD(p, lr=lr, momentum=spec.get("momentum", 0.9), weight_decay=wd)
    if name == "Adam":
        return lambda p: torch.optim.Adam(p, lr=lr, weight_decay=wd)
    if name == "AdamW":
        return lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=wd)
    if name == "SparseAdam":
        return lambda p: torch.optim.SparseAdam(list(p), lr=lr)
    raise ValueError(f"corpus optimizer {name!r} unknown: use SGD, Adam, AdamW or SparseAdam")


def workload(entry_id: str) -> Workload:
    """The corpus entry ``entry_id`` as a Workload."""
    by_id = {e["id"]: e for e in _corpus()["entries"]}
    if entry_id not in by_id:
        raise KeyError(f"no corpus entry {entry_id!r} in {CORPUS_JSON.name} ({len(by_id)} entries)")
    return entry_workload(by_id[entry_id])


def entry_workload(e: dict[str, Any]) -> Workload:
    """A corpus-shaped entry (``id``, ``family``, ``params``, ``optimizer`` ...) as a Workload."""
    fields = FAMILIES[e["family"]](e["params"])
    loop = {"keep_output": e["keep_output"]} if "keep_output" in {f.name for f in dataclasses.fields(Workload)} else {}
    return Workload(
        name=e["id"], description=e["description"], optimizer=_optimizer(e["optimizer"]),
        optimizer_impl=e["optimizer"]["impl"], batch_size=e["batch_size"], precision=e["precision"],
        accumulation_steps=e.get("accumulation_steps", 1), tags=(e["family"], e["split"], *e.get("tags", ())),
        **loop, **fields,
    )


def __getattr__(name: str) -> Workload:
    # memfit's `corpus.py:ID` loader asks the module for the attribute ID; dunders and others are not entries
    if name.startswith("c") and name[1:4].isdigit():
        try:
            return workload(name)
        except KeyError as exc:
            raise AttributeError(str(exc)) from exc
    raise AttributeError(name)
