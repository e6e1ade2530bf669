"""Does the static-shape fake mode trace the same step as FakeTensorMode, on models beyond the accuracy suite?

``memfit/_torch_private.py: StaticShapeFakeTensorMode`` runs meta kernels where FakeTensorMode runs Python written
for symbolic sizes. For each model below (random weights, nothing downloaded) this traces the training step twice,
once with each mode, and compares every allocation (bytes, op, module, phase, shape, dtype, category) and the
event order; differences are listed by op. Each mode keeps its own dispatch cache (StaticShapeFakeTensorMode
swaps FakeTensorMode's class-wide cache while entered), so neither trace reads the other's outputs. Speed is not
measured here (the second trace of a model hits the first's cache): see benchmarks/estimate_time.py.

    python benchmarks/fake_mode_equivalence.py \
        --out benchmarks/results/estimate/fake_mode_equivalence_cpu_torch<X.Y>_<yyyymmdd>.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from memfit import Workload  # noqa: E402
from memfit import _torch_private as tp  # noqa: E402
from memfit.estimate.gpus import gpu_spec  # noqa: E402
from memfit.estimate.trace import trace_workload  # noqa: E402


def _ce(out, batch):  # noqa: ANN001, ANN202
    return F.cross_entropy(out, batch[1])


def _images(size: int, classes: int = 1000):  # noqa: ANN202
    return lambda n: (torch.randn(n, 3, size, size), torch.randint(0, classes, (n,)))


def _timm(name: str, **kw):  # noqa: ANN003, ANN202
    def build():  # noqa: ANN202
        import timm

        return timm.create_model(name, pretrained=False, **kw)

    return build


def _hf(config_name: str, model_name: str, **config):  # noqa: ANN003, ANN202
    def build():  # noqa: ANN202
        import transformers

        return getattr(transformers, model_name)(getattr(transformers, config_name)(**config))

    return build


def _tokens(vocab: int, length: int):  # noqa: ANN202
    return lambda n: torch.randint(0, vocab, (n, length))


def _monai(name: str, **kw):  # noqa: ANN003, ANN202
    def build():  # noqa: ANN202
        import monai.networks.nets as nets

        return getattr(nets, name)(**kw)

    return build


def _volumes(channels: int, size: int, classes: int):  # noqa: ANN202
    return lambda n: (torch.randn(n, channels, size, size, size), torch.randint(0, classes, (n, size, size, size)))


def _seg_loss(out, batch):  # noqa: ANN001, ANN202
    out = out[0] if isinstance(out, (list, tuple)) else out
    if out.dim() == batch[1].dim() + 2:  # DynUNet stacks deep-supervision heads in training
        out = out[:, 0]
    return F.cross_entropy(out.float(), batch[1])


def _smp(arch: str, encoder: str):  # noqa: ANN202
    def build():  # noqa: ANN202
        import segmentation_models_pytorch as smp

        return getattr(smp, arch)(encoder, encoder_weights=None, in_channels=3, classes=2)

    return build


def _lm(vocab: int):  # noqa: ANN202
    def forward(model, batch):  # noqa: ANN001, ANN202
        return model(input_ids=batch, labels=batch)

    return forward


def _workloads() -> list[Workload]:
    adamw = lambda p: torch.optim.AdamW(p, lr=1e-3)  # noqa: E731
    sgd = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
    img = dict(loss=_ce, optimizer=adamw)
    lm = dict(loss=lambda out, b: out.loss, optimizer=adamw)
    seg3d = dict(loss=_seg_loss, optimizer=adamw)
    return [
        Workload(name="timm_resnet50_fp16", model=_timm("resnet50"), batch=_images(224), batch_size=16,
                 precision="fp16", loss=_ce, optimizer=sgd),
        Workload(name="timm_swin_tiny_bf16", model=_timm("swin_tiny_patch4_window7_224"), batch=_images(224),
                 batch_size=8, precision="bf16", **img),
        Workload(name="timm_deit_small_fp32", model=_timm("deit_small_patch16_224"), batch=_images(224),
                 batch_size=8, precision="fp32", **img),
        Workload(name="timm_mobilenetv3_bf16", model=_timm("mobilenetv3_large_100"), batch=_images(224),
                 batch_size=16, precision="bf16", **img),
        Workload(name="timm_maxvit_tiny_bf16", model=_timm("maxvit_tiny_tf_224"), batch=_images(224),
                 batch_size=4, precision="bf16", **img),
        Workload(name="timm_regnety_016_channels_last", model=_timm("regnety_016"), batch=_images(224),
                 batch_size=16, precision="bf16", channels_last=True, **img),
        Workload(name="hf_bert_base_bf16", model=_hf("BertConfig", "BertForMaskedLM"), batch=_tokens(30522, 256),
                 forward=_lm(30522), batch_size=4, precision="bf16", **lm),
        Workload(name="hf_llama_small_bf16", model=_hf("LlamaConfig", "LlamaForCausalLM", hidden_size=512,
                 intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                 vocab_size=32000), batch=_tokens(32000, 512), forward=_lm(32000), batch_size=4,
                 precision="bf16", **lm),
        Workload(name="hf_t5_small_fp32", model=_hf("T5Config", "T5ForConditionalGeneration", d_model=256,
                 d_ff=1024, num_layers=3, num_heads=4, decoder_start_token_id=0, pad_token_id=0), batch=_tokens(32128, 128), forward=_lm(32128),
                 batch_size=4, precision="fp32", **lm),
        Workload(name="monai_unetr_bf16", model=_monai("UNETR", in_channels=1, out_channels=3, img_size=(96,) * 3),
                 batch=_volumes(1, 96, 3), batch_size=1, precision="bf16", **seg3d),
        Workload(name="monai_segresnet_fp16", model=_monai("SegResNet", in_channels=4, out_channels=3),
                 batch=_volumes(4, 96, 3), batch_size=1, precision="fp16", **seg3d),
        Workload(name="monai_dynunet_bf16", model=_monai("DynUNet", spatial_dims=3, in_channels=1, out_channels=3,
                 kernel_size=[3, 3, 3, 3], strides=[1, 2, 2, 2], upsample_kernel_size=[2, 2, 2],
                 deep_supervision=True, deep_supr_num=2), batch=_volumes(1, 64, 3), batch_size=2,
                 precision="bf16", **seg3d),
        Workload(name="monai_attention_unet_fp32", model=_monai("AttentionUnet", spatial_dims=3, in_channels=1,
                 out_channels=3, channels=(16, 32, 64, 128), strides=(2, 2, 2)), batch=_volumes(1, 64, 3),
                 batch_size=2, precision="fp32", **seg3d),
        Workload(name="smp_fpn_effb0_fp16", model=_smp("FPN", "efficientnet-b0"),
                 batch=lambda n: (torch.randn(n, 3, 256, 256), torch.randint(0, 2, (n, 256, 256))),
                 batch_size=4, precision="fp16", loss=_seg_loss, optimizer=adamw),
        Workload(name="smp_deeplabv3plus_r50_bf16", model=_smp("DeepLabV3Plus", "resnet50"),
                 batch=lambda n: (torch.randn(n, 3, 256, 256), torch.randint(0, 2, (n, 256, 256))),
                 batch_size=4, precision="bf16", loss=_seg_loss, optimizer=adamw),
    ]


def _trace(work: Workload, mode_cls: type) -> tuple[list, tuple, list[str]]:
    original = tp.StaticShapeFakeTensorMode
    tp.StaticShapeFakeTensorMode = mode_cls
    try:
        tr = trace_workload(work, gpu_spec("h100"))
    finally:
        tp.StaticShapeFakeTensorMode = original
    allocs = [(a.nbytes, a.op, a.module, a.phase, a.step, tuple(a.shape), a.dtype, a.category) for a in tr.allocs]
    return allocs, (tuple(tr.ops), tuple(tr.keys)), list(tr.warnings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--names", help="comma-separated workload names (default: all)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    chosen = args.names.split(",") if args.names else None
    rows = []
    for work in _workloads():
        if chosen and work.name not in chosen:
            continue
        try:
            runs = {mode_cls.__name__: _trace(work, mode_cls)
                    for mode_cls in (tp.FakeTensorMode, tp.StaticShapeFakeTensorMode)}
        except Exception as exc:  # noqa: BLE001 - record and go on
            rows.append({"name": work.name, "error": f"{type(exc).__name__}: {exc}"[:300]})
            print(f"{work.name}: ERROR {rows[-1]['error']}", flush=True)
            continue
        (a_slow, e_slow, _), (a_fast, e_fast, warnings) = runs["FakeTensorMode"], runs["StaticShapeFakeTensorMode"]
        diffs = collections.Counter()
        for x, y in zip(a_slow, a_fast):
            if x != y:
                what = [f for f, u, v in zip(("bytes", "op", "module", "phase", "step", "shape", "dtype", "category"),
                                             x, y) if u != v]
                diffs[f"{x[1]}: {'/'.join(what)} {x[6]}->{y[6]}" if "dtype" in what else f"{x[1]}: {'/'.join(what)}"] += 1
        row = {
            "name": work.name, "precision": work.precision, "allocations": len(a_fast),
            "same_events": e_slow == e_fast and len(a_slow) == len(a_fast), "differences": dict(diffs),
            "bytes_moved": sum(y[0] - x[0] for x, y in zip(a_slow, a_fast)), "warnings": warnings,
        }
        rows.append(row)
        print(f"{work.name}: {len(a_fast)} allocations, events {'same' if row['same_events'] else 'DIFFER'}, "
              f"differences {dict(diffs) or 'none'}, bytes moved {row['bytes_moved']:+,}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
