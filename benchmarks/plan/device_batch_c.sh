#!/usr/bin/env bash
# This session's device calls (H100), from the repository root, writing under $OUT; carry .whl (nnU-Net's networks).
#   bash benchmarks/plan/device_batch_c.sh checks      # GPU tests ∥ patch search under caps, then the cuDNN-cache check
#   bash benchmarks/plan/device_batch_c.sh sweep MODELS # the plan sweep of MODELS (comma-separated), alone: it times
#   bash benchmarks/plan/device_batch_c.sh round3 MODELS # fit-half allocator traces ∥ patch search (r3), then the sweep
set -u
. benchmarks/estimate/_site.sh  # the carried wheels (nnU-Net's networks), PYTHONPATH, $OUT/card.txt
case "$1" in
  checks)
    (timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_plan.py tests/test_cudnn_rnn.py \
       tests/test_estimate.py tests/test_trace.py tests/test_cuda_emulation.py > "$OUT/gpu_tests.log" 2>&1) &
    (timeout 330 python3 benchmarks/plan/patch_caps_device.py run \
       --predictions benchmarks/results/plan/patch_caps_predictions_cpu_20261126_r2 --out "$OUT/patch" \
       --deadline-s 200 > "$OUT/patch.log" 2>&1) &
    wait
    timeout 200 python3 benchmarks/plan/cudnn_cache_under_cap.py --out "$OUT" > "$OUT/cudnn_cache.log" 2>&1
    tail -n 5 "$OUT/gpu_tests.log"; tail -n 8 "$OUT/patch.log"; tail -n 6 "$OUT/cudnn_cache.log"
    ;;
  round3)
    (timeout 200 python3 benchmarks/estimate/trace_entries.py c032_unet c006_tv_cls c001_tv_cls --out "$OUT" \
       > "$OUT/trace_entries.log" 2>&1) &
    (timeout 250 python3 benchmarks/plan/patch_caps_device.py run \
       --predictions benchmarks/results/plan/patch_caps_predictions_cpu_20261126_r3 --out "$OUT/patch" \
       --deadline-s 150 > "$OUT/patch.log" 2>&1) &
    wait
    tail -n 4 "$OUT/trace_entries.log"; tail -n 2 "$OUT/patch.log"
    timeout 300 python3 benchmarks/plan/sweep_device.py sweep --workloads "$2" \
      --plans benchmarks/results/plan/plan_sweep_predictions_cpu_20261126_r3 --out "$OUT/sweep" --deadline-s 100 \
      > "$OUT/sweep.log" 2>&1
    grep -E "GiB: plan|deadline|Error" "$OUT/sweep.log" | tail -n 20
    ;;
  sweep)
    timeout 560 python3 benchmarks/plan/sweep_device.py sweep --workloads "$2" \
      --plans benchmarks/results/plan/plan_sweep_predictions_cpu_20261126_r2 --out "$OUT/sweep" --deadline-s 100 \
      > "$OUT/sweep_$2.log" 2>&1
    grep -E "GiB: plan|deadline|Error" "$OUT/sweep_$2.log" | tail -n 20
    ;;
esac
