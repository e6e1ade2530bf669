#!/usr/bin/env bash
# Session 34's device calls (H200), from the repository root, writing under $OUT.
#   bash benchmarks/estimate/device_batch_m.sh int32 first|second   # convolutions beyond 2^31 - 1 elements, forward
#       # and each backward call, against the same ones just below (conv_int32_grid.py --cases)
#   bash benchmarks/estimate/device_batch_m.sh tests   # the GPU tests (one GPU)
set -u
. benchmarks/estimate/_site.sh  # PYTHONPATH, $OUT/card.txt, gpu_tests, gpu_test_files, draw_measurements

case "$1" in
  int32)
    timeout 560 python3 benchmarks/estimate/conv_int32_grid.py --cases "$2" --out "$OUT" --budget-s 500 \
      > "$OUT/int32_$2.log" 2>&1
    tail -n 3 "$OUT/int32_$2.log"
    ;;
  tests)
    gpu_tests 570
    ;;
esac
