"""Where an fp32 1x1 convolution's forward starts taking a large block on the GPU: 256 -> 64 channels over a
growing batch of 1024² images (2^28 ... 2^31 input elements), channels-last and NCHW, each call alone. The 72-call
grid at 512 and 1024 per axis (session 33) saw 10 GiB taken at 8 x 1024² channels-last, where the rule charges none.

    python benchmarks/estimate/conv_int32_probe.py > $OUT/conv_int32_probe.txt   # on a GPU
"""

from __future__ import annotations

import torch

MiB = 1 << 20


def main() -> None:
    torch.backends.cudnn.benchmark = False
    conv = torch.nn.Conv2d(256, 64, 1, bias=False).cuda()
    print(torch.cuda.get_device_name(0), torch.__version__, torch.backends.cudnn.version())
    print("layout batch elements input_MiB output_MiB transient_MiB")
    for fmt, name in ((torch.channels_last, "channels_last"), (torch.contiguous_format, "nchw")):
        c = conv.to(memory_format=fmt)
        for n in (1, 2, 4, 6, 7, 8):
            x = torch.randn(n, 256, 1024, 1024, device="cuda").contiguous(memory_format=fmt)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            with torch.no_grad():
                y = c(x)
            torch.cuda.synchronize()
            out = y.numel() * 4
            took = torch.cuda.max_memory_allocated() - before - out
            print(name, n, x.numel(), x.numel() * 4 // MiB, out // MiB, round(took / MiB, 1), flush=True)
            del x, y
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
