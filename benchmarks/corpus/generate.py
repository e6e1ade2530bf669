"""Draw the validation corpus: training-step configurations over families x precision x optimizer x batch x input
size x loss x loop, with a fixed seed, before any fitting; split them into a ``fit`` and a ``validation`` half.

    python benchmarks/corpus/generate.py            # writes benchmarks/corpus/corpus.json (committed)

The draw uses no memfit estimate: each configuration is kept small enough to measure in seconds on an 80 GB GPU
by a crude size rule of its own (``rough_peak_bytes``: parameters, optimizer state and activations from layer
counts and widths, deliberately pessimistic), which halves the batch (then the sequence or input size) until the
rule says at most 16 GiB. So the corpus does not depend on the estimator it judges. The split is stratified by
family (shuffled with the same seed, alternating), so both halves hold every family.

Only libraries the GPU machine has: torch, torchvision, timm, transformers, peft.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

SEED = 13  # issue 13
OUT = Path(__file__).resolve().parent / "corpus.json"
LIMIT_BYTES = 16 * 2**30
"""The size rule's ceiling; the rule is pessimistic, so measured peaks land below ~20 GB."""

QUOTAS = {
    "tv_cls": 12, "timm_cls": 10, "tv_seg": 6, "unet": 12, "hf_lm": 16, "hf_moe": 6, "hf_lora": 5,
    "hf_encoder": 10, "hf_seq2seq": 7, "hf_vision": 5, "rnn": 10, "detection": 3, "frozen_cnn": 5,
    "torch_encoder": 6, "mlp": 4, "sparse_embedding": 3,
}
"""Entries per family (120 in all, 60 per half)."""

# activation bytes per sample at 224x224 in fp32, pessimistic (forward saves + backward's largest transients)
_ACT_224 = {
    "resnet18": 45e6, "resnet50": 150e6, "mobilenet_v3_large": 80e6, "efficientnet_b0": 160e6,
    "convnext_tiny": 160e6, "regnet_y_400mf": 70e6, "vit_b_16": 160e6, "swin_t": 170e6, "densenet121": 200e6,
    "resnet34": 60e6, "efficientnet_b2": 240e6, "convnext_nano": 110e6, "vit_small_patch16_224": 80e6,
    "deit_tiny_patch16_224": 45e6, "swin_tiny_patch4_window7_224": 170e6, "mobilenetv3_large_100": 80e6,
    "regnety_008": 90e6, "resnet50d": 170e6,
}
# per sample at 512x512 in fp32 (torchvision segmentation runs ResNets at output stride 8)
_SEG_512 = {"deeplabv3_resnet50": 2.4e9, "fcn_resnet50": 2.2e9, "deeplabv3_mobilenet_v3_large": 0.6e9,
            "lraspp_mobilenet_v3_large": 0.3e9}


def _amp(entry: dict[str, Any]) -> float:
    return 1.0 if entry["precision"] == "fp32" else 0.6


def _lm_params(p: dict[str, Any]) -> float:
    ffn = p.get("ffn", 4 * p["hidden"]) * (p.get("experts", 1) + 2 * (p["arch"] == "qwen2_moe"))
    return p["vocab"] * p["hidden"] * 2 + p["layers"] * (4 * p["hidden"] ** 2 + 3 * p["hidden"] * ffn)


def rough_peak_bytes(entry: dict[str, Any]) -> float:
    """A pessimistic size rule (not memfit): 16 bytes per parameter (weights, grads, two Adam moments) plus
    activations from the batch, the widths and the layer count."""
    p, n, fam = entry["params"], entry["batch_size"], entry["family"]
    amp = _amp(entry)
    if fam in ("tv_cls", "timm_cls", "frozen_cnn", "hf_vision"):
        arch = {"vit": "vit_b_16", "swin": "swin_t", "convnext": "convnext_tiny"}.get(p["arch"], p["arch"])
        return 2e9 + n * _ACT_224[arch] * (p["size"] / 224) ** 2 * amp
    if fam == "tv_seg":
        return 2e9 + n * _SEG_512[p["arch"]] * (p["size"] / 512) ** 2 * amp
    if fam == "unet":
        voxels = p["size"] ** p["dims"]
        return 1e9 + n * voxels * p["features"][0] * 80 * amp + n * voxels * p["classes"] * 24
    if fam in ("hf_lm", "hf_moe", "hf_lora"):
        tokens = n * p["seq"]
        width = p["hidden"] * (1 + p.get("top_k", 0))
        act = tokens * p["layers"] * width * 40 * amp * (0.3 if p.get("checkpointing") else 1.0)
        return 1e9 + 16 * _lm_params(p) + act + tokens * p["vocab"] * 14
    if fam == "hf_encoder":
        tokens = n * p["seq"]
        attn = n * p["heads"] * p["seq"] ** 2 * 12 * p["layers"] if p["arch"] == "deberta_v2" else 0
        logits = tokens * p["vocab"] * 14 if p["task"] == "mlm" else 0
        return 1e9 + 16 * (p["vocab"] * p["hidden"] + 12 * p["layers"] * p["hidden"] ** 2) + (
            tokens * p["layers"] * p["hidden"] * 40 + attn) * amp + logits
    if fam == "hf_seq2seq":
        src = 1500 if p["arch"] == "whisper" else p["src"]
        tokens = n * (src + 2 * p["tgt"])
        return 1e9 + 16 * (p["vocab"] * p["d_model"] + 24 * p["layers"] * p["d_model"] ** 2) + (
            tokens * p["layers"] * p["d_model"] * 40 * amp + n * p["tgt"] * p["vocab"] * 14
            + (n * p["heads"] * src * src * 12 * p["layers"] if p["arch"] == "t5" else 0))
    if fam == "rnn":
        tokens = n * p["seq"]
        dirs = 2 if p.get("bidirectional") else 1
        out = p["vocab"] if p["task"] == "lm" else p["classes"]
        return 1e9 + 16 * (p.get("vocab", 0) * p.get("embed", 0) * 2 + 8 * p["layers"] * p["hidden"] ** 2 * dirs) + (
            tokens * p["layers"] * p["hidden"] * dirs * 60 * amp + tokens * out * 14)
    if fam == "detection":
        return 3e9 + n * 0.8e9 * (p["size"] / 512) ** 2 * amp
    if fam == "torch_encoder":
        tokens = n * p["seq"]
        act = tokens * p["layers"] * p["dim"] * 60 * amp * (0.3 if p.get("checkpoint") else 1.0)
        return 1e9 + 16 * (2 * p["vocab"] * p["dim"] + 12 * p["layers"] * p["dim"] ** 2) + act + tokens * p["vocab"] * 14
    if fam == "mlp":
        w = p["widths"]
        return 1e9 + 16 * sum(a * b for a, b in zip(w, w[1:])) + n * sum(w) * 20
    if fam == "sparse_embedding":
        return 1e9 + p["rows"] * p["dim"] * 16 + n * p["bag"] * p["dim"] * 12
    raise ValueError(fam)


def _optimizer(rng: random.Random, family: str) -> dict[str, Any]:
    if family == "sparse_embedding":
        name = rng.choice(["SparseAdam", "SGD"])
        return {"name": name, "impl": "default" if name == "SparseAdam" else "for-loop",
                "lr": 1e-3 if name == "SparseAdam" else 0.05}
    name = rng.choice(["SGD", "Adam", "AdamW"])
    impl = rng.choice(["foreach", "foreach", "fused", "for-loop"])
    spec: dict[str, Any] = {"name": name, "impl": impl}
    if name == "SGD":
        spec.update(lr=0.01, momentum=rng.choice([0.0, 0.9]), weight_decay=rng.choice([0.0, 1e-4]))
    else:
        spec.update(lr=rng.choice([1e-4, 3e-4, 1e-3]), weight_decay=rng.choice([0.0, 0.01, 0.05]))
    return spec


def _params(rng: random.Random, family: str) -> tuple[dict[str, Any], list[int], str]:
    """(parameters, batch sizes to draw from, one-line description)."""
    c = rng.choice
    if family == "tv_cls":
        arch = c(["resnet18", "resnet50", "mobilenet_v3_large", "efficientnet_b0", "convnext_tiny", "regnet_y_400mf",
                  "vit_b_16", "swin_t", "densenet121"])
        size = 224 if arch == "vit_b_16" else c([128, 160, 192, 224, 256, 288])
        p = {"arch": arch, "size": size, "classes": c([10, 37, 101, 397, 1000, 1001]),
             "channels_last": arch not in ("vit_b_16", "swin_t") and rng.random() < 0.3}
        return p, [16, 32, 48, 64, 96, 128], f"torchvision {arch} {size}px"
    if family == "timm_cls":
        arch = c(["resnet34", "resnet50d", "efficientnet_b2", "convnext_nano", "vit_small_patch16_224",
                  "deit_tiny_patch16_224", "swin_tiny_patch4_window7_224", "mobilenetv3_large_100", "regnety_008"])
        fixed = arch.startswith(("vit", "deit", "swin"))
        size = c([224, 256]) if fixed and not arch.startswith("swin") else (224 if fixed else c([160, 224, 256, 320]))
        p = {"arch": arch, "size": size, "classes": c([10, 100, 397, 1000]), "pass_img_size": fixed and size != 224,
             "drop_path": c([0.0, 0.1])}
        return p, [16, 32, 64, 128], f"timm {arch} {size}px"
    if family == "tv_seg":
        arch = c(list(_SEG_512))
        p = {"arch": arch, "size": c([256, 384, 512]), "classes": c([3, 7, 19, 21, 150]),
             "aux": arch in ("deeplabv3_resnet50", "fcn_resnet50") and rng.random() < 0.5,
             "loss": c(["ce", "dice_ce", "dice"])}
        return p, [2, 4, 8, 16], f"torchvision {arch} {p['size']}px, {p['loss']}"
    if family == "unet":
        dims = c([2, 2, 3, 3, 3])
        size = c([256, 384, 512]) if dims == 2 else c([64, 96, 128])
        f0 = c([16, 32])
        feats = [min(f0 * 2**i, 320) for i in range(c([4, 5, 6]) if dims == 3 else c([5, 6, 7]))]
        p = {"dims": dims, "size": size, "classes": c([2, 3, 5, 14]), "in_channels": c([1, 3, 4]),
             "features": feats, "norm": c(["instance", "batch"]),
             "loss": c(["ce", "dice", "dice_ce", "deep_supervision"])}
        return p, [1, 2, 4] if dims == 3 else [2, 4, 8, 16], f"U-Net {dims}-D {size}^{dims}, {p['loss']}"
    if family in ("hf_lm", "hf_moe", "hf_lora"):
        arch = (c(["gpt2", "llama", "qwen2", "mistral", "phi"]) if family == "hf_lm"
                else c(["mixtral", "qwen2_moe", "olmoe"]) if family == "hf_moe" else c(["gpt2", "llama"]))
        hidden = c([256, 512, 768, 1024]) if family != "hf_lora" else c([768, 1024, 2048])
        heads = hidden // 64
        p = {"arch": arch, "hidden": hidden, "heads": heads, "layers": c([2, 4, 6, 8]),
             "vocab": c([32000, 32003, 50257, 65024, 100277, 128256, 151936]), "seq": c([256, 512, 1024, 2048]),
             "ffn": c([2, 3, 4]) * hidden}
        if arch in ("llama", "qwen2", "mistral", "mixtral", "qwen2_moe"):
            p["kv_heads"] = c([h for h in (1, 2, 4, heads) if heads % h == 0])
        if family == "hf_moe":
            p.update(experts=c([4, 8, 16]), top_k=c([1, 2, 4]), ffn=c([256, 512]))
        if family == "hf_lora":
            p.update(lora_r=c([4, 8, 16, 64]), lora_targets=["c_attn"] if arch == "gpt2" else c(
                [["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj"]]))
        if arch != "gpt2" and rng.random() < 0.3:
            p["tie"] = True
        if family == "hf_lm" and rng.random() < 0.25:
            p["checkpointing"] = True
        return p, [1, 2, 4, 8, 16], f"{arch} {p['layers']}x{hidden}, vocab {p['vocab']}, {p['seq']} tokens"
    if family == "hf_encoder":
        arch = c(list(("bert", "roberta", "distilbert", "deberta_v2")))
        hidden = c([256, 512, 768])
        p = {"arch": arch, "hidden": hidden, "heads": hidden // 64, "layers": c([4, 6, 12]),
             "vocab": {"bert": 30522, "roberta": 50265, "distilbert": 30522, "deberta_v2": 128100}[arch],
             "seq": c([128, 256, 512]), "task": c(["cls", "mlm"]), "classes": c([2, 3, 5, 17])}
        if rng.random() < 0.3:
            p["freeze_layers"] = p["layers"] // 2
        return p, [8, 16, 32, 64], f"{arch} {p['layers']}x{hidden} {p['task']}, {p['seq']} tokens"
    if family == "hf_seq2seq":
        arch = c(["t5", "bart", "whisper"])
        d = c([256, 384, 512])
        p = {"arch": arch, "d_model": d, "heads": d // 64, "layers": c([2, 4, 6]),
             "vocab": {"t5": 32128, "bart": 50265, "whisper": 51865}[arch], "src": c([256, 512]),
             "tgt": c([64, 128, 256])}
        return p, [4, 8, 16, 32], f"{arch} {p['layers']}+{p['layers']}x{d}"
    if family == "hf_vision":
        arch = c(["vit", "swin", "convnext"])
        return {"arch": arch, "size": 224, "classes": c([10, 100, 1000])}, [16, 32, 64], f"HF {arch} 224px"
    if family == "rnn":
        cell, task = c(["lstm", "gru"]), c(["lm", "tagger"])
        p: dict[str, Any] = {"cell": cell, "task": task, "hidden": c([256, 512, 1024]), "layers": c([1, 2, 3]),
                             "seq": c([64, 128, 256, 512] if cell == "lstm" else [64, 128, 256])}
        if task == "lm":
            p.update(vocab=c([10000, 32000, 50257]), embed=c([256, 512]))
        else:
            p.update(features=c([40, 80]), classes=c([29, 41, 61]), bidirectional=rng.random() < 0.6, vocab=0)
        return p, [16, 32, 64, 128], f"{cell} {task} {p['layers']}x{p['hidden']}, {p['seq']} steps"
    if family == "detection":
        arch = c(["fasterrcnn_mobilenet_v3_large_fpn", "retinanet_resnet50_fpn", "fcos_resnet50_fpn"])
        return ({"arch": arch, "size": c([320, 512]), "objects": c([4, 12]), "classes": 91}, [2, 4],
                f"torchvision {arch}")
    if family == "frozen_cnn":
        arch, head = c([("resnet50", ["fc."]), ("resnet50", ["layer4.", "fc."]), ("convnext_tiny", ["classifier."]),
                        ("efficientnet_b0", ["classifier."]), ("vit_b_16", ["heads."])])
        return ({"arch": arch, "head": head, "size": 224, "classes": c([10, 37, 200])}, [32, 64, 128],
                f"torchvision {arch} frozen but {'/'.join(head)}")
    if family == "torch_encoder":
        dim = c([256, 512, 768])
        p = {"dim": dim, "heads": dim // 64, "layers": c([2, 4, 6]), "vocab": c([8192, 32000]),
             "seq": c([128, 256, 512]), "norm_first": c([True, False]), "checkpoint": rng.random() < 0.3}
        return p, [8, 16, 32, 64], f"nn.TransformerEncoder {p['layers']}x{dim}"
    if family == "mlp":
        w0 = c([512, 1024, 4096])
        widths = [w0] + [c([1024, 2048, 4096, 8192]) for _ in range(c([2, 3]))]
        return {"widths": widths, "classes": c([10, 1000, 1001])}, [256, 1024, 4096], f"MLP {widths}"
    if family == "sparse_embedding":
        p = {"rows": c([100_000, 1_000_000]), "dim": c([64, 128, 256]), "bag": c([16, 64]),
             "classes": c([2, 10, 64]), "dense_head": True}
        return p, [1024, 4096], f"EmbeddingBag(sparse) {p['rows']}x{p['dim']}"
    raise ValueError(family)


def _shrink(entry: dict[str, Any]) -> None:
    """Halve the batch, then the sequence / input size, until the size rule allows the entry."""
    p = entry["params"]
    while rough_peak_bytes(entry) > LIMIT_BYTES:
        if entry["batch_size"] > 1:
            entry["batch_size"] //= 2
        elif p.get("seq", 0) > 64:
            p["seq"] //= 2
        elif p.get("size", 0) > 64 and entry["family"] not in ("hf_vision", "frozen_cnn"):
            p["size"] //= 2
        else:
            break


def _entry(rng: random.Random, family: str) -> dict[str, Any]:
    """One configuration of ``family``: its parameters, precision, optimizer, batch, loop and accumulation."""
    params, batches, text = _params(rng, family)
    precision = rng.choice(["fp32", "bf16", "bf16", "fp16"])
    if family == "sparse_embedding":
        precision = "fp32"  # SparseAdam and sparse SGD with GradScaler is not a recipe anyone uses
    entry = {
        "family": family, "params": params, "precision": precision,
        "optimizer": _optimizer(rng, family), "batch_size": rng.choice(batches),
        "keep_output": rng.random() < 0.5,
        "accumulation_steps": rng.choice([1] * 8 + [2, 4]),
    }
    if entry["optimizer"]["name"] == "SparseAdam":
        params["dense_head"] = False  # SparseAdam takes sparse grads only
    _shrink(entry)
    entry["description"] = (f"{text}, {precision}, {entry['optimizer']['name']} "
                            f"({entry['optimizer']['impl']}), batch {entry['batch_size']}, "
                            f"{'keeps' if entry['keep_output'] else 'drops'} the output"
                            + (f", {entry['accumulation_steps']} micro-batches"
                               if entry["accumulation_steps"] > 1 else ""))
    entry["rough_peak_gib"] = round(rough_peak_bytes(entry) / 2**30, 2)
    return entry


SUPPLEMENT_SEED = 1327
"""Seed of the fit-side supplements (``draw_supplement``), drawn on 2026-11-27 after the validation half had judged
the estimator: more entries of the families whose validation entries were farthest off, all on the fit side."""


def draw_supplement(family: str, count: int, *, precision: str | None = None, seed: int = SUPPLEMENT_SEED,
                    where: Callable[[dict[str, Any]], bool] | None = None, tag: str = "") -> list[dict[str, Any]]:
    """``count`` more *fit* entries of ``family``, drawn as the corpus draws them (with ``precision`` only, and
    only those ``where`` accepts, if given: the other draws are skipped), ids ``s<seed>_<family>_<tag><nn>``.

    The validation half tunes nothing, so where it finds the estimator off, the rule is studied on entries like
    these: same generator, other draws (``benchmarks/estimate/probe_cases.py`` measures them with their streams).
    """
    rng = random.Random(f"{seed}:{family}:{precision}" + (f":{tag}" if tag else ""))
    found: list[dict[str, Any]] = []
    while len(found) < count:
        entry = _entry(rng, family)
        if (precision is None or entry["precision"] == precision) and (where is None or where(entry)):
            entry.update(id=f"s{seed}_{family}_{tag}{len(found):02d}", split="fit")
            found.append(entry)
    return found


def draw() -> dict[str, Any]:
    rng = random.Random(SEED)
    entries: list[dict[str, Any]] = []
    for family, count in QUOTAS.items():
        for _ in range(count):
            entries.append(_entry(rng, family))
    # split: per family, shuffled, alternating, so both halves hold every family
    by_family: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        by_family.setdefault(e["family"], []).append(e)
    offset = 0  # families of odd size give their extra entry to the two halves in turn: 60 / 60
    for members in by_family.values():
        order = list(range(len(members)))
        rng.shuffle(order)
        for rank, i in enumerate(order):
            members[i]["split"] = "fit" if (rank + offset) % 2 == 0 else "validation"
        offset ^= len(members) % 2
    for i, e in enumerate(entries):
        e["id"] = f"c{i:03d}_{e['family']}"
    keys = ("id", "split", "family", "description", "params", "precision", "optimizer", "batch_size",
            "accumulation_steps", "keep_output", "rough_peak_gib")
    return {"schema": 1, "seed": SEED, "generator": "benchmarks/corpus/generate.py",
            "size_rule_limit_gib": LIMIT_BYTES / 2**30,
            "entries": [{k: e[k] for k in keys} for e in entries]}


def main() -> None:
    corpus = draw()
    OUT.write_text(json.dumps(corpus, indent=1) + "\n")
    splits = Counter(e["split"] for e in corpus["entries"])
    print(f"wrote {OUT}: {len(corpus['entries'])} entries, {dict(splits)}")
    print("precision", dict(Counter(e["precision"] for e in corpus["entries"])))
    print("optimizer", dict(Counter(f"{e['optimizer']['name']}/{e['optimizer']['impl']}" for e in corpus["entries"])))
    print("keep_output", dict(Counter(e["keep_output"] for e in corpus["entries"])))


if __name__ == "__main__":
    main()
