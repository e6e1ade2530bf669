"""Layouts through UperNet's pooling branches (pool, 1x1 conv, BN, ReLU, bilinear upsample) and their cat, on the GPU
(``python benchmarks/estimate/psp_layouts.py cuda``) or as memfit traces them (``... fake``, on the CPU): where
they part. HF UperNet-ConvNeXt's PSP bottleneck gets an NCHW input on an H200 and a channels-last one in memfit's
trace: ``... upernet`` (GPU) prints the layout of every convolution's input in the fourth draw's UperNet-ConvNeXt
(upernet_conv_layouts_h200_torch2.11_20261129_s32.txt)."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn


def _layout(t: torch.Tensor) -> str:
    kind = "other"
    if t.is_contiguous():
        kind = "NCHW"
    elif t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        kind = "CL"
    return f"{tuple(t.shape)} {t.stride()} {kind}"


def run(device: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 16, 16, 768, device=device).permute(0, 3, 1, 2)  # channels-last, as the backbone gives it
    conv = nn.Conv2d(768, 512, 1, bias=False).to(device)
    bn = nn.BatchNorm2d(512).to(device)
    with torch.autocast("cuda" if device == "cuda" else "cpu", dtype=dtype):
        outs = [x]
        for scale in (1, 2, 3, 6):
            pooled = F.adaptive_avg_pool2d(x, scale)
            convolved = conv(pooled)
            normed = bn(convolved)
            relu = torch.relu(normed)
            up = F.interpolate(relu, size=(16, 16), mode="bilinear", align_corners=False)
            for what, t in (("pool", pooled), ("conv", convolved), ("bn", normed), ("relu", relu), ("up", up)):
                print(scale, what, _layout(t))
            outs.append(up)
        print("cat", _layout(torch.cat(outs, dim=1)))


def upernet_convs() -> None:
    """Every convolution's input layout in the fourth draw's UperNet-ConvNeXt, forward under fp16 autocast (GPU)."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "zoo"))
    import holdout4

    w = holdout4.h4_hf_upernet_convnext
    model = w.model().cuda().train()
    batch = {k: v.cuda() for k, v in w.batch(8).items()}

    def hook(name: str):  # noqa: ANN202
        return lambda module, args: print(name, _layout(args[0]), args[0].dtype)

    for name, m in model.named_modules():
        if isinstance(m, nn.Conv2d):
            m.register_forward_pre_hook(hook(name))
    with torch.autocast("cuda", dtype=torch.float16):
        out = model(**batch)
    print("loss", float(out.loss))


if __name__ == "__main__":
    if sys.argv[1:] == ["cuda"]:
        run("cuda", torch.float16)
    elif sys.argv[1:] == ["upernet"]:
        upernet_convs()
    else:
        from torch._subclasses.fake_tensor import FakeTensorMode

        from memfit.estimate.cuda_emulation import CudaSemantics

        with FakeTensorMode(allow_non_fake_inputs=True), CudaSemantics():
            run("cpu", torch.float16)
