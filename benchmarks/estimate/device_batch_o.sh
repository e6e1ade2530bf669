#!/usr/bin/env bash
# Session 36's device calls (H200), from the repository root, writing under $OUT.
#   bash benchmarks/estimate/device_batch_o.sh op_blocks NAME,...   # zoo steps' blocks named by the op that took
#       # them (op_blocks.py run), side by side on the one GPU
#   bash benchmarks/estimate/device_batch_o.sh tests   # the GPU tests (one GPU)
set -u
. benchmarks/estimate/_site.sh  # PYTHONPATH, $OUT/card.txt, gpu_tests, gpu_test_files, draw_measurements

case "$1" in
  op_blocks)
    timeout 560 python3 benchmarks/estimate/op_blocks.py run "$2" --out "$OUT" > "$OUT/op_blocks.log" 2>&1
    tail -n 20 "$OUT/op_blocks.log"
    ;;
  tests)
    gpu_tests 570
    ;;
esac
