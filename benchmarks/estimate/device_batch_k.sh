#!/usr/bin/env bash
# Session 32's device calls (H200), from the repository root, writing under $OUT.
#   bash benchmarks/estimate/device_batch_k.sh fp32conv   # fp32 3x3 convolutions over channel pairs, each backward
#       # call alone (calibrate_cudnn.py --only conv_fp32_channels), then DPT's two head convolutions as its head
#       # runs them (nn.Conv2d with bias, after a bilinear upsample), alone
#   bash benchmarks/estimate/device_batch_k.sh channels_last   # convolutions on channels-last inputs, with a
#       # channels-last weight or an NCHW one (calibrate_cudnn.py --only conv_channels_last)
#   bash benchmarks/estimate/device_batch_k.sh holdout5 NAMES   # the fifth draw measured (peaks and the smallest
#       # cap that runs, device_zoo.sh) from its committed predictions; ZOO_DONE=FOLDER resumes an earlier call's
#   bash benchmarks/estimate/device_batch_k.sh emulation   # the GPU tests of tests/test_cuda_emulation.py (the
#       # channels-last convolutions and upsampling among them)
#   bash benchmarks/estimate/device_batch_k.sh streams5   # the allocator streams of the fifth draw's bound miss (the
#       # channels-last bilinear U-Net) and largest over-estimate (CvT), then the emulation GPU tests
#   bash benchmarks/estimate/device_batch_k.sh channels_last_odd   # channels-last convolutions of channel counts
#       # that are not powers of two (calibrate_cudnn.py --only conv_channels_last_odd)
#   bash benchmarks/estimate/device_batch_k.sh streams_upernet   # the allocator stream of the fourth draw's
#       # UperNet-ConvNeXt, whose fits_in moved +1.3 -> +4.9 % with the channels-last sizes (allocated exact)
#   bash benchmarks/estimate/device_batch_k.sh channels_last_wide   # channels-last convolutions from 512-2048
#       # channels (calibrate_cudnn.py --only conv_channels_last_wide)
#   bash benchmarks/estimate/device_batch_k.sh psp_layouts   # layouts through UperNet's pooling branches on the GPU
#   bash benchmarks/estimate/device_batch_k.sh tests   # the GPU tests (one GPU)
set -u
. benchmarks/estimate/_site.sh  # PYTHONPATH, $OUT/card.txt, gpu_tests, gpu_test_files, draw_measurements

# calibrate_cudnn.py's family $1 into $OUT, its log $OUT/$2.log
grid() {
  timeout 500 python3 benchmarks/calibrate_cudnn.py --only "$1" --out "$OUT" > "$OUT/$2.log" 2>&1
  tail -n 3 "$OUT/$2.log"
}

# the allocator streams of zoo entries $2... into $OUT (trace_entries.py), its log $OUT/$1.log
streams() {
  local log=$1; shift
  timeout 240 python3 benchmarks/estimate/trace_entries.py --zoo "$@" --out "$OUT" > "$OUT/$log.log" 2>&1
  tail -n 4 "$OUT/$log.log"
}

case "$1" in
  fp32conv)
    grid conv_fp32_channels fp32conv
    timeout 120 python3 - > "$OUT/dpt_head_alone.txt" 2>&1 <<'PY'
import sys
import torch, torch.nn as nn
sys.path.insert(0, "benchmarks")
from calibrate_cudnn import _transient as transient
print(torch.__version__, torch.backends.cudnn.version(), torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)
for cin, cout, hw in ((256, 128, 192), (128, 32, 384)):
    conv = nn.Conv2d(cin, cout, 3, padding=1).cuda()
    x = torch.randn(8, cin, hw // 2, hw // 2, device="cuda")
    x = nn.functional.interpolate(x, scale_factor=2, mode="bilinear", align_corners=True).requires_grad_()
    y, fwd = transient(lambda: conv(x))
    _, bwd = transient(lambda: torch.autograd.grad(y, (x, conv.weight, conv.bias), torch.randn_like(y)))
    print(f"{cin}->{cout} at {hw}^2 batch 8: input {x.nbytes} output {y.nbytes} forward transient {fwd} backward {bwd}")
PY
    cat "$OUT/dpt_head_alone.txt"
    ;;
  channels_last)
    grid conv_channels_last channels_last
    ;;
  holdout5)
    draw_measurements benchmarks/results/estimate/trace_coverage_cpu_torch2.14_20261129_holdout5_h200_s32.json \
      zoo_holdout5_measurements "$2"
    ;;
  emulation)
    gpu_test_files gpu_tests_emulation 300 tests/test_cuda_emulation.py
    ;;
  streams5)
    streams streams5 h5_torch_bilinear_unet_cl h5_hf_cvt
    bash "$0" emulation
    ;;
  channels_last_odd)
    grid conv_channels_last_odd cl_odd
    ;;
  streams_upernet)
    streams streams_upernet h4_hf_upernet_convnext
    ;;
  channels_last_wide)
    grid conv_channels_last_wide cl_wide
    ;;
  layouts)
    # the layout each convolution of UperNet-ConvNeXt (fourth draw) gets on the GPU, forward under fp16 autocast
    timeout 200 python3 benchmarks/estimate/psp_layouts.py upernet > "$OUT/upernet_conv_layouts.txt" 2>&1
    tail -n 12 "$OUT/upernet_conv_layouts.txt"
    ;;
  psp_layouts)
    timeout 120 python3 benchmarks/estimate/psp_layouts.py cuda > "$OUT/psp_layouts_cuda.txt" 2>&1
    cat "$OUT/psp_layouts_cuda.txt"
    ;;
  tests)
    gpu_tests 570
    ;;
esac
