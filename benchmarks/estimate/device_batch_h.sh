#!/usr/bin/env bash
# Session 27's device calls (H200), from the repository root, writing under $OUT.
#   bash benchmarks/estimate/device_batch_h.sh calibrate  # patch embeddings' filter gradients alone (the image wants
#                                                         # no gradient): 2-D and 3-D, fp32/bf16/fp16
#   bash benchmarks/estimate/device_batch_h.sh caps       # Video Swin-T under caps around memfit's walked fits_in
#                                                         # (6.73 GB; the bisection alone said 6.17), side by side
#   bash benchmarks/estimate/device_batch_h.sh windows    # XCiT-nano, PVT-v2 and FCN under caps across the range
#                                                         # the walk raised their answers by (4-5 %)
#   bash benchmarks/estimate/device_batch_h.sh measure    # `memfit measure` (bisection, then three caps above) on
#                                                         # FCN-ResNet50, PVT-v2 and Video Swin-T
#   bash benchmarks/estimate/device_batch_h.sh tests      # the GPU tests (one GPU)
set -u
. benchmarks/estimate/_site.sh  # PYTHONPATH, $OUT/card.txt
case "$1" in
  calibrate)
    timeout 300 python3 benchmarks/calibrate_cudnn.py --only conv_patchify_wgrad --out "$OUT" > "$OUT/calibrate.log" 2>&1
    tail -n 3 "$OUT/calibrate.log"
    ;;
  caps)
    timeout 400 python3 benchmarks/estimate/trace_entries.py --zoo ho_tv_swin3d_t@6600000000 ho_tv_swin3d_t@6650000000 \
      ho_tv_swin3d_t@6700000000 ho_tv_swin3d_t@6730000000 ho_tv_swin3d_t@6800000000 ho_tv_swin3d_t@7000000000 \
      --out "$OUT" > "$OUT/caps.log" 2>&1
    tail -n 8 "$OUT/caps.log"
    ;;
  windows)
    # three zoo steps whose answers the walk raised 4-5 % (XCiT-nano, PVT-v2, FCN-ResNet50), under caps from their
    # GPU-bisected fits_in up to memfit's walked answer: does the GPU, too, run out above a cap where it ran?
    args=""
    for c in 3340 3360 3380 3400 3420 3440 3460 3480; do args="$args ho_timm_xcit_nano@${c}000000"; done
    for c in 3810 3830 3850 3870 3890; do args="$args ho_timm_pvt_v2_b1@${c}000000"; done
    for c in 4720 4760 4800 4840 4880 4920; do args="$args tv_fcn_resnet50@${c}000000"; done
    timeout 500 python3 benchmarks/estimate/trace_entries.py --zoo $args --out "$OUT" > "$OUT/windows.log" 2>&1
    cut -c1-120 "$OUT/windows.log" | tail -n 20
    ;;
  measure)
    # `memfit measure` with its new check above the bisection, three steps side by side (each trial a fresh process)
    for spec in torchvision_models.py:tv_fcn_resnet50 holdout.py:ho_timm_pvt_v2_b1 holdout.py:ho_tv_swin3d_t; do
      name=${spec#*:}
      timeout 560 python3 -m memfit.cli measure "benchmarks/zoo/$spec" --json > "$OUT/measure_$name.json" \
        2> "$OUT/measure_$name.log" &
    done
    wait
    for f in "$OUT"/measure_*.json; do python3 -c "
import json, sys; d = json.loads(open(sys.argv[1]).read()[open(sys.argv[1]).read().index('{'):])
caps = [(t['cap_bytes'], t['ok']) for t in d['trials'] if t['cap_bytes']]
print(sys.argv[1].split('/')[-1], 'fits_in', d['fits_in_bytes'], 'trials', sorted(caps))" "$f"; done
    ;;
  tests)
    gpu_tests 570
    ;;
esac
