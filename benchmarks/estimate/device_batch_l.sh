#!/usr/bin/env bash
# Session 33's device calls (H200), from the repository root, writing under $OUT.
#   bash benchmarks/estimate/device_batch_l.sh holdout6 NAMES   # the sixth draw measured (peaks and the smallest
#       # cap that runs, device_zoo.sh) from its committed predictions; ZOO_DONE=FOLDER resumes an earlier call's
#   bash benchmarks/estimate/device_batch_l.sh layouts   # tests/test_fake_mode.py's GPU tests: pointwise outputs
#       # and their gradients on tensors that are contiguous and channels-last at once, CUDA against the trace
#   bash benchmarks/estimate/device_batch_l.sh attention   # test_trace's fp32 efficient-attention backward test,
#       # which failed at [8-63] in the suite's first run this session: alone, then after test_fake_mode's GPU tests
#   bash benchmarks/estimate/device_batch_l.sh channels_last_large   # channels-last convolutions over 512-1024 per
#       # axis (calibrate_cudnn.py --only conv_channels_last_large), where the grid stopped at 384
#   bash benchmarks/estimate/device_batch_l.sh tests   # the GPU tests (one GPU)
set -u
. benchmarks/estimate/_site.sh  # PYTHONPATH, $OUT/card.txt, gpu_tests, gpu_test_files, draw_measurements

case "$1" in
  holdout6)
    draw_measurements benchmarks/results/estimate/trace_coverage_cpu_torch2.14_20261129_holdout6_h200_s33.json \
      zoo_holdout6_measurements "$2"
    ;;
  layouts)
    gpu_test_files gpu_tests_layouts 200 tests/test_fake_mode.py
    ;;
  attention)
    for tests in "tests/test_trace.py" "tests/test_fake_mode.py tests/test_trace.py"; do
      echo "== $tests" >> "$OUT/gpu_tests_attention.log"
      timeout 120 python3 -m pytest -q -m "gpu and not multigpu" $tests -k "efficient_attention_backward or cudas" \
        -p no:cacheprovider >> "$OUT/gpu_tests_attention.log" 2>&1
    done
    grep -E "passed|failed" "$OUT/gpu_tests_attention.log"; cat "$OUT/card.txt" >> "$OUT/gpu_tests_attention.log"
    ;;
  channels_last_large)
    timeout 540 python3 benchmarks/calibrate_cudnn.py --only conv_channels_last_large --out "$OUT" \
      > "$OUT/cl_large.log" 2>&1
    tail -n 3 "$OUT/cl_large.log"
    ;;
  tests)
    gpu_tests 570
    ;;
esac
