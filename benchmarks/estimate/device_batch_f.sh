#!/usr/bin/env bash
# Session 15's device calls (H100), from the repository root, writing under $OUT; carry .whl (MONAI, smp, nnU-Net
# and its networks: benchmarks/integrations/nnunet_wheels.sh, then monai==1.6.1 and segmentation_models_pytorch==0.6.0).
#   bash benchmarks/estimate/device_batch_f.sh zoo     # side by side: the GPU tests; the allocator streams of the
#                                                      # zoo entries the CPU estimate misses most; the bisection of
#                                                      # the two entries session 14 left unmeasured
#   bash benchmarks/estimate/device_batch_f.sh nnunet  # nnU-Net's trainer on memfit's plans, planned on this GPU
#                                                      # (settle on), each under its budget as a cap
set -u
. benchmarks/estimate/_site.sh
case "$1" in
  zoo)
    mkdir -p "$OUT/traces"
    timeout 560 python3 -m pytest -q -m gpu -p no:cacheprovider -rs $(grep -l "mark.gpu" tests/test_*.py) \
      > "$OUT/gpu_tests.log" 2>&1 &
    tests=$!
    timeout 300 python3 benchmarks/estimate/trace_entries.py --zoo --out "$OUT/traces" timm_inception_v3 \
      timm_nfnet_l0 tv_efficientnet_b0 timm_vgg16_bn hf_mixtral_small nn_transformer_seq2seq \
      > "$OUT/traces.log" 2>&1 &
    traces=$!
    ZOO_BUDGET_S=420 bash benchmarks/estimate/device_zoo.sh hf_phi_small,monai_swin_unetr_issue13 > "$OUT/zoo.log" 2>&1
    wait $traces; cat "$OUT/traces.log"
    wait $tests; tail -n 15 "$OUT/gpu_tests.log"
    tail -n 14 "$OUT/zoo.log"
    ;;
  nnunet)
    timeout 570 python3 benchmarks/integrations/nnunet_device.py --out "$OUT" --iterations 20 --deadline-s 480 \
      > "$OUT/nnunet.log" 2>&1
    tail -n 60 "$OUT/nnunet.log"
    ;;
esac
