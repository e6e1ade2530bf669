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
. benchmarks/estimate/_site.sh  # PYTHONPATH, $OUT/card.txt
case "$1" in
  bound)
    mkdir -p "$OUT/bound_caps"
    # entry:cap — r3d-18 (H100 need 5.1 %, left out by that fit), the half-frozen ConvNeXt-T (the fit's
    # closest, 0.1 % inside), WGAN-GP's critic (0.55 % inside), MViT-v1-B (0.6 % inside)
    for pair in tv_r3d_18:2193620992 frozen_timm_convnext_half:2195718144 ho_wgan_gp_critic:1298137088 \
                h3_tv_mvit_v1_b:5641338880; do
      timeout 140 python3 benchmarks/estimate/cap_repeats.py "${pair%%:*}" --caps "${pair##*:}" --repeats 3 --jobs 3 \
        --out "$OUT/bound_caps/${pair%%:*}.json" >> "$OUT/bound_caps/cap_repeats.log" 2>&1
    done
    cp "$OUT/card.txt" "$OUT/bound_caps/"
    cat "$OUT/bound_caps/cap_repeats.log" | grep -v "^\[" | tail -n 8
    ;;
  bound2)
    # the final fit (4.3 %, session-30 code): the fit steps closest to their bound, and r3d-18, 3 times each under it
    mkdir -p "$OUT/bound_caps_final"
    for pair in h3_tv_mvit_v1_b:5611978752 frozen_timm_convnext_half:2202009600 ho_wgan_gp_critic:1302331392 \
                tv_r3d_18:2327838720; do
      timeout 140 python3 benchmarks/estimate/cap_repeats.py "${pair%%:*}" --caps "${pair##*:}" --repeats 3 --jobs 3 \
        --out "$OUT/bound_caps_final/${pair%%:*}.json" >> "$OUT/bound_caps_final/cap_repeats.log" 2>&1
    done
    cp "$OUT/card.txt" "$OUT/bound_caps_final/"
    grep -v "^\[" "$OUT/bound_caps_final/cap_repeats.log" | tail -n 8
    timeout 400 python3 -m pytest -q -m "gpu and not multigpu" tests --ignore=tests/test_architecture.py \
      -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
    tail -n 5 "$OUT/gpu_tests.log"; cat "$OUT/card.txt" >> "$OUT/gpu_tests.log"
    ;;
  plans)
    # plans made with the 4.3 % margin (plan_quality.py predict, CPU), each run under its budget's cap in a fresh
    # process; then the GPU tests with the session's final code
    mkdir -p "$OUT/plan_verify"
    timeout 300 python3 benchmarks/plan_quality.py verify --predictions benchmarks/results/plan/plan_predictions_cpu_20261129_s30 \
      --out "$OUT/plan_verify" > "$OUT/plan_verify/verify.log" 2>&1
    cp "$OUT/card.txt" "$OUT/plan_verify/"; grep -v "^\[" "$OUT/plan_verify/verify.log" | tail -n 14
    timeout 280 python3 -m pytest -q -m "gpu and not multigpu" tests --ignore=tests/test_architecture.py \
      -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
    tail -n 3 "$OUT/gpu_tests.log"; cat "$OUT/card.txt" >> "$OUT/gpu_tests.log"
    ;;
  plans2)
    # the plans again with the checkpoint mode they chose (plan_quality.py's _plan_changes had dropped it)
    mkdir -p "$OUT/plan_verify"
    timeout 400 python3 benchmarks/plan_quality.py verify --predictions benchmarks/results/plan/plan_predictions_cpu_20261129_s30 \
      --out "$OUT/plan_verify" > "$OUT/plan_verify/verify.log" 2>&1
    cp "$OUT/card.txt" "$OUT/plan_verify/"; grep -v "^\[" "$OUT/plan_verify/verify.log" | tail -n 14
    ;;
  plans3)
    # GPT-2's plans again in the loop they were made for (keep_output False: TrainStep's)
    mkdir -p "$OUT/plan_verify"
    timeout 300 python3 benchmarks/plan_quality.py verify --models gpt2 \
      --predictions benchmarks/results/plan/plan_predictions_cpu_20261129_s30 --out "$OUT/plan_verify" \
      > "$OUT/plan_verify/verify.log" 2>&1
    cp "$OUT/card.txt" "$OUT/plan_verify/"; grep -v "^\[" "$OUT/plan_verify/verify.log" | tail -n 6
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
    timeout 570 python3 -m pytest -q -m "gpu and not multigpu" tests --ignore=tests/test_architecture.py \
      -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
    tail -n 5 "$OUT/gpu_tests.log"; cat "$OUT/card.txt" >> "$OUT/gpu_tests.log"
    ;;
esac
