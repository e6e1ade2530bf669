#!/usr/bin/env bash
# Session 34's device calls (H200), from the repository root, writing under $OUT.
#   bash benchmarks/estimate/device_batch_m.sh grid first|second|strided   # conv_grid.py --cases: convolutions
#       # beyond 2^31 - 1 elements against the same just below (first, second), strided 1x1 ones (strided)
#   bash benchmarks/estimate/device_batch_m.sh holdout7 NAMES   # the seventh draw measured (peaks and the smallest
#       # cap that runs, device_zoo.sh) from its committed predictions; ZOO_DONE=FOLDER resumes an earlier call's
#   bash benchmarks/estimate/device_batch_m.sh streams NAMES   # zoo entries' allocator streams (trace_entries.py)
#   bash benchmarks/estimate/device_batch_m.sh tests   # the GPU tests (one GPU)
set -u
. benchmarks/estimate/_site.sh  # PYTHONPATH, $OUT/card.txt, gpu_tests, gpu_test_files, draw_measurements

case "$1" in
  grid)
    timeout 560 python3 benchmarks/estimate/conv_grid.py --cases "$2" --out "$OUT" --budget-s 500 \
      > "$OUT/grid_$2.log" 2>&1
    tail -n 3 "$OUT/grid_$2.log"
    ;;
  holdout7)
    draw_measurements benchmarks/results/estimate/trace_coverage_cpu_torch2.14_20261129_holdout7_h200_s34.json \
      zoo_holdout7_measurements "$2"
    ;;
  streams)
    timeout 300 python3 benchmarks/estimate/trace_entries.py --zoo ${2//,/ } --out "$OUT" > "$OUT/streams.log" 2>&1
    tail -n 4 "$OUT/streams.log"
    ;;
  tests)
    gpu_tests 570
    ;;
esac
