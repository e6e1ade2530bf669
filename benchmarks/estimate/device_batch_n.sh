#!/usr/bin/env bash
# Session 35's device calls (H200), from the repository root, writing under $OUT.
#   bash benchmarks/estimate/device_batch_n.sh streams ID[@CAP],...   # zoo entries' allocator streams, uncapped or
#       # under a cap of CAP bytes (trace_entries.py --zoo), side by side on the one GPU
#   bash benchmarks/estimate/device_batch_n.sh holdout8 NAMES   # the eighth draw measured (peaks and the smallest
#       # cap that runs, device_zoo.sh) from its committed predictions; ZOO_DONE=FOLDER resumes an earlier call's
#   bash benchmarks/estimate/device_batch_n.sh holdout9 NAMES   # the ninth draw, the same way
#   bash benchmarks/estimate/device_batch_n.sh grid half_large   # conv_grid.py --cases half_large
#   bash benchmarks/estimate/device_batch_n.sh tests   # the GPU tests (one GPU)
set -u
. benchmarks/estimate/_site.sh  # PYTHONPATH, $OUT/card.txt, gpu_tests, gpu_test_files, draw_measurements

case "$1" in
  streams)
    timeout 560 python3 benchmarks/estimate/trace_entries.py --zoo ${2//,/ } --out "$OUT" > "$OUT/streams.log" 2>&1
    tail -n 8 "$OUT/streams.log"
    ;;
  holdout8)
    draw_measurements benchmarks/results/estimate/trace_coverage_cpu_torch2.14_20261129_holdout8_h200_s35.json \
      zoo_holdout8_measurements "$2"
    ;;
  holdout9)
    draw_measurements benchmarks/results/estimate/trace_coverage_cpu_torch2.14_20261129_holdout9_h200_s35.json \
      zoo_holdout9_measurements "$2"
    ;;
  grid)
    timeout 560 python3 benchmarks/estimate/conv_grid.py --cases "$2" --out "$OUT" --budget-s 500 \
      > "$OUT/grid_$2.log" 2>&1
    tail -n 3 "$OUT/grid_$2.log"
    ;;
  tests)
    gpu_tests 570
    ;;
esac
