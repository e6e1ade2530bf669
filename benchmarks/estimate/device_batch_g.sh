#!/usr/bin/env bash
# Session 16's device call (H100), from the repository root, writing under $OUT; carry .whl (MONAI, smp, nnU-Net
# and its networks: benchmarks/integrations/nnunet_wheels.sh, then monai==1.6.1 and segmentation_models_pytorch==0.6.0).
#   bash benchmarks/estimate/device_batch_g.sh sums   # side by side: where CUDA's autograd engine sums gradients in
#                                                     # place (sum_in_place.py, real steps under the profiler), the
#                                                     # trace tests on the GPU, and allocator streams of Swin-UNETR's
#                                                     # plain loop and two ResNet-50s
#   bash benchmarks/estimate/device_batch_g.sh caps   # the zoo entries whose bound fell under the measured cap after
#                                                     # the in-place sums (streams capped at memfit's fits_in and at
#                                                     # the measured cap), and each cap tried three times
set -u
. benchmarks/estimate/_site.sh
case "$1" in
  sums)
    mkdir -p "$OUT/traces"
    timeout 500 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/test_trace.py > "$OUT/gpu_tests.log" 2>&1 &
    tests=$!
    timeout 400 python3 benchmarks/estimate/trace_entries.py --zoo --out "$OUT/traces" monai_swin_unetr_issue13 \
      tv_resnet50 timm_resnet50 timm_swin_tiny > "$OUT/traces.log" 2>&1 &
    traces=$!
    timeout 500 python3 benchmarks/estimate/sum_in_place.py --device cuda --out "$OUT/sums_a.json" \
      monai_swin_unetr_issue13 gap:swin_unetr_ce14 tv_resnet50 timm_resnet50 timm_swin_tiny timm_vit_b16 \
      timm_convnext_tiny timm_densenet121 timm_inception_v3 timm_efficientnet_b0 timm_nfnet_l0 timm_vgg16_bn \
      tv_efficientnet_b0 timm_maxvit_tiny c016_timm_cls > "$OUT/sums_a.log" 2>&1 &
    a=$!
    timeout 500 python3 benchmarks/estimate/sum_in_place.py --device cuda --out "$OUT/sums_b.json" \
      hf_gpt2 hf_llama_small hf_mixtral_small hf_t5_small hf_bert_base_mlm nn_transformer_seq2seq \
      smp_unet_r34_issue13 monai_unet3d_dicece monai_unetr nnunet_plain_3d nnunet_resenc_3d lstm_lm_issue13 \
      hf_whisper_tiny c038_unet c116_mlp > "$OUT/sums_b.log" 2>&1 &
    b=$!
    wait $a $b $traces $tests
    tail -n 3 "$OUT/sums_a.log" "$OUT/sums_b.log"; cat "$OUT/traces.log"; tail -n 8 "$OUT/gpu_tests.log"
    (cd "$OUT" && tar czf sums_traces.tar.gz traces && rm -rf traces)
    ;;
  caps)
    mkdir -p "$OUT/traces"
    timeout 300 python3 benchmarks/estimate/trace_entries.py --zoo --out "$OUT/traces" tv_r3d_18 tv_r3d_18@2141192192 \
      tv_r3d_18@2222645575 frozen_timm_convnext_half frozen_timm_convnext_half@2105540608 \
      frozen_timm_convnext_half@2193620992 > "$OUT/traces.log" 2>&1 &
    traces=$!
    timeout 400 python3 benchmarks/estimate/cap_repeats.py monai_swin_unetr_issue13 --jobs 4 --repeats 3 \
      --caps 10995116277,11344208646,11393134979,11951669248 --out "$OUT/repeats_swin.json" > "$OUT/repeats.log" 2>&1 &
    swin=$!
    timeout 300 python3 benchmarks/estimate/cap_repeats.py tv_r3d_18 --repeats 3 \
      --caps 2141192192,2214592512,2222645575 --out "$OUT/repeats_r3d.json" >> "$OUT/repeats.log" 2>&1
    timeout 300 python3 benchmarks/estimate/cap_repeats.py frozen_timm_convnext_half --repeats 3 \
      --caps 2105540608,2178940928,2193620992 --out "$OUT/repeats_convnext.json" >> "$OUT/repeats.log" 2>&1
    wait $traces $swin
    cat "$OUT/traces.log" "$OUT/repeats.log"
    (cd "$OUT" && tar czf caps_traces.tar.gz traces && rm -rf traces)
    ;;
esac
