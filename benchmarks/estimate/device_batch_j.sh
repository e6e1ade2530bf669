#!/usr/bin/env bash
# Session 30's device calls (H200), from the repository root, writing under $OUT.
#   bash benchmarks/estimate/device_batch_j.sh bound   # the steps outside the validation half closest to (or under)
#       # the 4 % bound a first fit proposed (one that left its worst step out: dropped after this run), each run 3
#       # times under that bound's cap (cap_repeats.py): the cap
#       # memfit's "fits" is decided with must run. Caps: fits_in_upper_bytes of the s30 accuracy files (--rebound)
#   bash benchmarks/estimate/device_batch_j.sh bound2   # the final 4.3 % bound's caps on its closest fit steps and
#       # r3d-18 (3 runs each), then the GPU tests
#   bash benchmarks/estimate/device_batch_j.sh plans   # the 4.3 % margin's plans (plan_quality.py predict, committed)
#       # run under their budgets' caps (plan_quality.py verify), then the GPU tests
#   bash benchmarks/estimate/device_batch_j.sh plans2  # the same plans with their checkpoint modes (the fix)
#   bash benchmarks/estimate/device_batch_j.sh plans3  # GPT-2's plans in TrainStep's loop (keep_output False)
#   bash benchmarks/estimate/device_batch_j.sh streams   # the allocator streams of r3d-18 (uncapped and under the
#       # 4 % bound's cap) and of the half-frozen ConvNeXt-T (trace_entries.py --zoo)
#   bash benchmarks/estimate/device_batch_j.sh stem   # 3-D stems' cuDNN blocks, and two video CNNs' streams
#   bash benchmarks/estimate/device_batch_j.sh tests   # the GPU tests (one GPU)
set -u
. benchmarks/estimate/_site.sh  # PYTHONPATH, $OUT/card.txt, gpu_tests

# Each entry:cap pair 3 times (3 side by side) under its cap (cap_repeats.py), into $OUT/$1.
cap_checks() {
  local out=$OUT/$1 pair; shift
  mkdir -p "$out"
  for pair in "$@"; do
    timeout 140 python3 benchmarks/estimate/cap_repeats.py "${pair%%:*}" --caps "${pair##*:}" --repeats 3 --jobs 3 \
      --out "$out/${pair%%:*}.json" >> "$out/cap_repeats.log" 2>&1
  done
  cp "$OUT/card.txt" "$out/"; grep -v "^\[" "$out/cap_repeats.log" | tail -n 8
}

# The session's plans (plan_predictions_cpu_20261129_s30) run under their caps within $1 seconds (plan_quality.py
# verify; the rest of the arguments passed on), into $OUT/plan_verify.
plan_verify() {
  local limit=$1; shift
  mkdir -p "$OUT/plan_verify"
  timeout "$limit" python3 benchmarks/plan_quality.py verify "$@" \
    --predictions benchmarks/results/plan/plan_predictions_cpu_20261129_s30 --out "$OUT/plan_verify" \
    > "$OUT/plan_verify/verify.log" 2>&1
  cp "$OUT/card.txt" "$OUT/plan_verify/"; grep -v "^\[" "$OUT/plan_verify/verify.log" | tail -n 14
}
case "$1" in
  bound)
    # entry:cap — r3d-18 (H100 need 5.1 %, left out by that fit), the half-frozen ConvNeXt-T (the fit's
    # closest, 0.1 % inside), WGAN-GP's critic (0.55 % inside), MViT-v1-B (0.6 % inside)
    cap_checks bound_caps tv_r3d_18:2193620992 frozen_timm_convnext_half:2195718144 ho_wgan_gp_critic:1298137088 \
      h3_tv_mvit_v1_b:5641338880
    ;;
  bound2)
    # the final fit (4.3 %, session-30 code): the fit steps closest to their bound, and r3d-18, 3 times each under it
    cap_checks bound_caps_final h3_tv_mvit_v1_b:5611978752 frozen_timm_convnext_half:2202009600 \
      ho_wgan_gp_critic:1302331392 tv_r3d_18:2327838720
    gpu_tests 400
    ;;
  plans)
    # plans made with the 4.3 % margin (plan_quality.py predict, CPU), each run under its budget's cap in a fresh
    # process; then the GPU tests with the session's final code
    plan_verify 300
    gpu_tests 280
    ;;
  plans2)
    # the plans again with the checkpoint mode they chose (plan_quality.py's _plan_changes had dropped it)
    plan_verify 400
    ;;
  plans3)
    # GPT-2's plans again in the loop they were made for (keep_output False: TrainStep's)
    plan_verify 300 --models gpt2
    ;;
  streams)
    # the allocator streams of the steps the 4 % bound missed or nearly missed, uncapped and under that bound's cap
    timeout 300 python3 benchmarks/estimate/trace_entries.py --zoo tv_r3d_18 tv_r3d_18@2193620992 \
      frozen_timm_convnext_half --out "$OUT" > "$OUT/streams.log" 2>&1
    tail -n 5 "$OUT/streams.log"; ls -la "$OUT"
    ;;
  stem)
    # 3-D stems (video, volumes) from 1-4 channels: forward and filter-gradient blocks (calibrate_cudnn.py
    # --only conv_3d_stem), and the allocator streams of the other video CNNs with such a stem
    timeout 300 python3 benchmarks/calibrate_cudnn.py --only conv_3d_stem --out "$OUT" > "$OUT/stem.log" 2>&1
    mkdir -p "$OUT/video" && timeout 200 python3 benchmarks/estimate/trace_entries.py --zoo tv_r2plus1d_18 h2_tv_mc3_18 \
      --out "$OUT/video" >> "$OUT/stem.log" 2>&1
    tail -n 4 "$OUT/stem.log"; ls "$OUT" "$OUT/video"
    ;;
  tests)
    gpu_tests 570
    ;;
esac
