#!/usr/bin/env bash
# Session 38's device calls (H200), from the repository root, writing under $OUT.
#   bash benchmarks/estimate/device_batch_q.sh deterministic   # the fifteenth draw (zoo/deterministic.py fresh):
#       # its steps measured (peaks, then the smallest cap that runs) from their committed predictions, and beside
#       # them cuDNN's deterministic algorithms' workspaces on the calibration grids (calibrate_cudnn.py
#       # --deterministic), one family after another
#   bash benchmarks/estimate/device_batch_q.sh sixteenth   # the sixteenth draw (zoo/deterministic.py sixteenth),
#       # beside the CUDA emulation's GPU tests and the deterministic index ops' blocks
#   bash benchmarks/estimate/device_batch_q.sh sixteenth_rest FOLDER NAMES   # its entries left, and the probe
#   bash benchmarks/estimate/device_batch_q.sh probe NAME[,NAME]   # the largest blocks alive at each step's peak
#   bash benchmarks/estimate/device_batch_q.sh draw COVERAGE_JSON KIND NAMES   # any fresh draw (see _site.sh)
#   bash benchmarks/estimate/device_batch_q.sh tests   # the GPU tests (one GPU)
set -u
. benchmarks/estimate/_site.sh  # PYTHONPATH, $OUT/card.txt, gpu_tests, draw_measurements, deterministic_names,
# cudnn_grids

case "$1" in
  deterministic)
    names=$(deterministic_names fresh det2)
    ZOO_RESERVE_GIB=24 draw_measurements \
      benchmarks/results/estimate/trace_coverage_cpu_torch2.14_20261130_deterministic_fresh_h200_s38.json \
      zoo_deterministic_fresh_measurements "$names" &
    GRID_FLAGS=--deterministic cudnn_grids 500 conv_narrow conv_head_half conv_3d_half conv conv_large \
      conv_fp32_channels conv_channels_last conv_pointwise_half
    wait
    tail -n 20 "$OUT"/calibration/*.log
    # a call brings back a limited number of files: one archive
    tar czf "$OUT/calibration.tar.gz" -C "$OUT" calibration && rm -rf "$OUT/calibration"
    ;;
  sixteenth)  # the sixteenth draw from its committed predictions, beside the GPU tests of the CUDA emulation and
    # the deterministic index ops' blocks (calibrate_deterministic_index.py)
    names=$(deterministic_names sixteenth det3)
    ZOO_RESERVE_GIB=24 draw_measurements \
      benchmarks/results/estimate/trace_coverage_cpu_torch2.14_20261130_deterministic_sixteenth_h200_s38.json \
      zoo_deterministic_sixteenth_measurements "$names" &
    gpu_test_files gpu_tests_emulation 500 tests/test_cuda_emulation.py
    timeout 60 python3 benchmarks/calibrate_deterministic_index.py --out "$OUT" > "$OUT/deterministic_index.log" 2>&1
    tail -n 3 "$OUT/deterministic_index.log"
    wait
    ;;
  sixteenth_rest)  # the sixteenth draw's entries an earlier call left ($2: its folder, committed), beside the
    # CUDA emulation's GPU tests and the upsampling probe
    ZOO_DONE=$2 ZOO_BUDGET_S=${ZOO_BUDGET_S:-240} ZOO_RESERVE_GIB=24 draw_measurements \
      benchmarks/results/estimate/trace_coverage_cpu_torch2.14_20261130_deterministic_sixteenth_h200_s38.json \
      zoo_deterministic_sixteenth_measurements "$3" &
    gpu_test_files gpu_tests_emulation 250 tests/test_cuda_emulation.py
    python3 benchmarks/estimate/upsampling_probe.py > "$OUT/upsampling_probe.json" 2> "$OUT/upsampling_probe.log"
    wait
    ;;
  probe)  # what is alive at the peak of the steps $2 (comma-separated), beside the CUDA emulation's GPU tests
    timeout 400 python3 benchmarks/estimate/peak_blocks_probe.py "$2" > "$OUT/peak_blocks.json" 2> "$OUT/peak_blocks.log" &
    gpu_test_files gpu_tests_emulation 250 tests/test_cuda_emulation.py
    wait
    tail -n 3 "$OUT/peak_blocks.log"
    ;;
  draw)
    draw_measurements "$2" "$3" "$4"
    ;;
  tests)
    gpu_tests 570
    ;;
esac
