#!/usr/bin/env bash
# Session 27's device calls (H200), from the repository root, writing under $OUT.
#   bash benchmarks/estimate/device_batch_h.sh calibrate  # patch embeddings' filter gradients alone (the image wants
#                                                         # no gradient): 2-D and 3-D, fp32/bf16/fp16
#   bash benchmarks/estimate/device_batch_h.sh caps       # Video Swin-T under caps around memfit's walked fits_in
#                                                         # (6.73 GB; the bisection alone said 6.17), side by side
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
  tests)
    timeout 570 python3 -m pytest -q -m "gpu and not multigpu" tests --ignore=tests/test_architecture.py \
      -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
    tail -n 5 "$OUT/gpu_tests.log"; cat "$OUT/card.txt" >> "$OUT/gpu_tests.log"
    ;;
esac
