#!/usr/bin/env bash
# Session 20's device calls (H100), from the repository root, writing under $OUT; carry .whl.
#   bash benchmarks/plan/device_batch_f.sh calibrated gpt2   # plans made with the default (calibrated) speed model,
#                                                            # near-ties settled by timing them (memfit.plan.race),
#                                                            # run under their caps and timed against the sweeps'
#                                                            # fastest fitting configurations
#   bash benchmarks/plan/device_batch_f.sh tie               # GPT-2 9 GiB with session 19's tied calibration
#   bash benchmarks/plan/device_batch_f.sh tests             # the GPU tests of the race
set -u
. benchmarks/estimate/_site.sh  # the carried wheels, PYTHONPATH, $OUT/card.txt
R=benchmarks/results/plan
case "$1" in
  calibrated)
    timeout 570 python3 benchmarks/plan/sweep_device.py calibrated --out "$OUT" --workloads "$2" \
      --plans "$R/plan_sweep_predictions_cpu_20261128_r8" \
      --sweeps "gpt2=$R/plan_sweep_h100_torch2.11_20261126_final,unet2d=$R/plan_sweep_h100_torch2.11_20261126_final,unet3d=$R/plan_sweep_h100_torch2.11_20261126_final,vit_b16=$R/plan_sweep_h100_torch2.11_20261127_r6" \
      > "$OUT/calibrated_$2.log" 2>&1
    grep -v "^\[" "$OUT/calibrated_$2.log" | tail -n 30
    ;;
  tie)  # GPT-2 at 9 GiB planned with session 19's second-host calibration, whose near-tie the plan missed
    mkdir -p "$OUT/tie"
    timeout 570 python3 benchmarks/plan/sweep_device.py calibrated --out "$OUT/tie" --workloads gpt2 --budgets 9 \
      --calibration "$R/plan_calibrated_h100_torch2.11_20261128/calibrations_second_host.json" \
      --plans "$R/plan_sweep_predictions_cpu_20261128_r8" --rounds 20 --repeats 3 \
      --sweeps "gpt2=$R/plan_sweep_h100_torch2.11_20261126_final" > "$OUT/tie/tie_gpt2.log" 2>&1
    grep -v "^\[" "$OUT/tie/tie_gpt2.log" | tail -n 30
    ;;
  tests)
    timeout 300 python3 -m pytest -q -m gpu tests/test_plan_race.py > "$OUT/tests.log" 2>&1
    tail -n 5 "$OUT/tests.log"
    ;;
esac
