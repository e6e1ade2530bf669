#!/usr/bin/env bash
# Session 39's device calls (H200), from the repository root, writing under $OUT.
#   bash benchmarks/estimate/device_batch_r.sh seventeenth   # the seventeenth draw (zoo/deterministic.py
#       # seventeenth) from its committed predictions, beside the four cuDNN calibration grids whose deterministic
#       # runs session 38 lost, each run with the setting and without it in this same call
#   bash benchmarks/estimate/device_batch_r.sh seventeenth_rest   # its bisections the first call left, resumed
#       # from the committed folder
#   bash benchmarks/estimate/device_batch_r.sh roi_grid   # what roi_align's compiled path allocates under
#       # deterministic algorithms (calibrate_roi_align_deterministic.py), beside the GPU tests
#   bash benchmarks/estimate/device_batch_r.sh streams NAME[,NAME[@CAP]]   # allocator streams of zoo steps
#       # (trace_entries.py), beside the CUDA emulation's GPU tests
#   bash benchmarks/estimate/device_batch_r.sh tests   # the GPU tests (one GPU)
set -u
. benchmarks/estimate/_site.sh  # PYTHONPATH, $OUT/card.txt, gpu_tests, draw_measurements, deterministic_names,
# cudnn_grids

case "$1" in
  seventeenth)
    names=$(deterministic_names seventeenth det4)
    ZOO_RESERVE_GIB=48 draw_measurements \
      benchmarks/results/estimate/trace_coverage_cpu_torch2.14_20261130_deterministic_seventeenth_h200_s39.json \
      zoo_deterministic_seventeenth_measurements "$names" &
    families="conv_narrow conv_head_half conv_large conv_pointwise_half"
    GRID_FLAGS=--deterministic cudnn_grids 500 $families &
    cudnn_grids 500 $families &
    wait
    tail -n 5 "$OUT"/calibration/*.log
    # a call brings back a limited number of files: one archive
    tar czf "$OUT/calibration.tar.gz" -C "$OUT" calibration && rm -rf "$OUT/calibration"
    ;;
  seventeenth_rest)
    names=$(deterministic_names seventeenth det4)
    ZOO_DONE=benchmarks/results/estimate/zoo_deterministic_seventeenth_measurements_h200_torch2.11_20261130 \
      ZOO_BUDGET_S=${ZOO_BUDGET_S:-300} draw_measurements \
      benchmarks/results/estimate/trace_coverage_cpu_torch2.14_20261130_deterministic_seventeenth_h200_s39.json \
      zoo_deterministic_seventeenth_measurements "$names"
    ;;
  roi_grid)
    timeout 420 python3 benchmarks/calibrate_roi_align_deterministic.py --out "$OUT" --budget-s 330 \
      > "$OUT/roi_align_deterministic.log" 2>&1 &
    gpu_tests 560
    wait
    tail -n 50 "$OUT/roi_align_deterministic.log"
    ;;
  streams)
    timeout 400 python3 benchmarks/estimate/trace_entries.py --zoo ${2//,/ } --out "$OUT" > "$OUT/streams.log" 2>&1 &
    gpu_test_files gpu_tests_emulation 300 tests/test_cuda_emulation.py
    wait
    tail -n 8 "$OUT/streams.log"
    ;;
  tests)
    gpu_tests 570
    ;;
esac
