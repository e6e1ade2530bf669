"""Layouts through UperNet's pooling branches (pool, 1x1 conv, BN, ReLU, bilinear upsample) and their cat, on the GPU
(`python benchmarks/estimate/psp_layouts.py cuda`) or as memfit traces them (`... fake`, CPU): where they part."""
import sys

import torch
import torch.nn.functional as F
from torch import nn


def fmt(t):
    return f"{tuple(t.shape)} {t.stride()} {'CL' if t.dim()==4 and t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous() else 'NCHW' if t.is_contiguous() else 'other'}"

def run(device, dtype):
    torch.manual_seed(0)
    x = torch.randn(8, 16, 16, 768, device=device).permute(0, 3, 1, 2)  # channels-last, as the backbone gives it
    conv = nn.Conv2d(768, 512, 1, bias=False).to(device)
    bn = nn.BatchNorm2d(512).to(device)
    with torch.autocast(device.split(':')[0] if device != 'cpu' else 'cpu', dtype=dtype):
        outs = [x]
        for scale in (1, 2, 3, 6):
            p = F.adaptive_avg_pool2d(x, scale); print(scale, 'pool', fmt(p))
            c = conv(p); print(scale, 'conv', fmt(c))
            b = torch.relu(bn(c)); print(scale, 'bn+relu', fmt(b))
            u = F.interpolate(b, size=(16, 16), mode='bilinear', align_corners=False); print(scale, 'up', fmt(u))
            outs.append(u)
        cat = torch.cat(outs, dim=1); print('cat', fmt(cat))

if __name__ == '__main__':
    if sys.argv[1] == 'cuda':
        run('cuda', torch.float16)
    else:
        sys.path.insert(0, 'src')
        from torch._subclasses.fake_tensor import FakeTensorMode

        from memfit.estimate.cuda_emulation import CudaSemantics
        with FakeTensorMode(allow_non_fake_inputs=True), CudaSemantics():
            run('cpu', torch.float16)
