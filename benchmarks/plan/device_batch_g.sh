#!/usr/bin/env bash
# Session 25's device calls (H200), from the repository root, writing under $OUT.
#   bash benchmarks/plan/device_batch_g.sh vit   # ViT-B/16 at 4 and 5 GiB, the plans a GPU user gets by default
#                                                # (calibrated on this card, near-ties raced), run under their caps
#                                                # and timed against the H100 sweep's fastest fitting
#                                                # configurations: 60 interleaved rounds x 3 repeats (session 20: 20 x 2)
#   bash benchmarks/plan/device_batch_g.sh control # the 5 and 4 GiB plans, their fastest contenders and a second
#                                                # copy of each plan (an A/A control), 60 rounds x 3 repeats
#   bash benchmarks/plan/device_batch_g.sh tests # the GPU tests (one GPU)
set -u
. benchmarks/estimate/_site.sh  # PYTHONPATH, $OUT/card.txt
R=benchmarks/results/plan
case "$1" in
  vit)
    timeout 570 python3 benchmarks/plan/sweep_device.py calibrated --out "$OUT" --workloads vit_b16 --budgets 4,5 \
      --rounds 60 --repeats 3 --plans "$R/plan_sweep_predictions_cpu_20261128_r8" \
      --sweeps "vit_b16=$R/plan_sweep_h100_torch2.11_20261127_r6" > "$OUT/calibrated_vit_b16.log" 2>&1
    grep -v "^\[" "$OUT/calibrated_vit_b16.log" | tail -n 30
    ;;
  control)
    timeout 570 python3 benchmarks/plan/sweep_device.py control --out "$OUT" --budgets 5,4 --rounds 60 --repeats 3 \
      --judged "$R/plan_vit5_h200_torch2.11_20261128_s25/plan_calibrated_vit_b16.json" > "$OUT/control_vit_b16.log" 2>&1
    grep -v "^\[" "$OUT/control_vit_b16.log" | tail -n 10
    ;;
  tests)
    gpu_tests 570
    ;;
esac
