#!/usr/bin/env bash
# Session 12's device calls (H100), from the repository root, writing under $OUT; carry .whl (nnU-Net's networks).
#   bash benchmarks/plan/device_batch_d.sh settle   # the patch search planned on the GPU (--settle), then its
#                                                   # chosen patches and every larger rung under the caps
#   bash benchmarks/plan/device_batch_d.sh tests    # the GPU tests
set -u
. benchmarks/estimate/_site.sh  # the carried wheels (nnU-Net's networks), PYTHONPATH, $OUT/card.txt
case "$1" in
  settle)
    timeout 300 python3 benchmarks/plan/patch_caps_device.py plan --settle --gpu h100 --out "$OUT/plans" \
      > "$OUT/plan.log" 2>&1
    tail -n 30 "$OUT/plan.log"
    timeout 250 python3 benchmarks/plan/patch_caps_device.py run --predictions "$OUT/plans" --out "$OUT/patch" \
      --deadline-s 180 > "$OUT/patch.log" 2>&1
    tail -n 40 "$OUT/patch.log"
    ;;
  tests)
    # every file with a test marked gpu (one card: the multi-GPU ones skip themselves); the device lacks the
    # architecture test's grimp, so the files are named
    timeout 560 python3 -m pytest -q -m gpu -p no:cacheprovider -rs $(grep -l "mark.gpu" tests/test_*.py) \
      > "$OUT/gpu_tests.log" 2>&1
    tail -n 15 "$OUT/gpu_tests.log"
    ;;
esac
