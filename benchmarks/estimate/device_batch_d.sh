#!/usr/bin/env bash
# One device call (memory only, side by side): the 1x1 half-precision convolution grid, the fp16 corpus entries
# measured again with the GradScaler settled (run_steps(settle_scaler=True)), the fit-side probes' allocator
# streams, and the GPU tests of the estimator. Run from the repository root; writes under $OUT.
#   bash benchmarks/estimate/device_batch_d.sh          # carry .whl (MONAI, smp, nnU-Net's networks: _site.sh)
set -u
. benchmarks/estimate/_site.sh
FP16=c004_tv_cls,c005_tv_cls,c006_tv_cls,c021_timm_cls,c023_tv_seg,c024_tv_seg,c035_unet,c039_unet,c040_hf_lm,\
c042_hf_lm,c050_hf_lm,c055_hf_lm,c059_hf_moe,c066_hf_lora,c067_hf_encoder,c072_hf_encoder,c078_hf_seq2seq,\
c080_hf_seq2seq,c081_hf_seq2seq,c082_hf_seq2seq,c086_hf_vision,c091_rnn,c093_rnn,c094_rnn,c097_rnn,\
c100_detection,c109_torch_encoder,c113_mlp
(timeout 200 python3 benchmarks/calibrate_cudnn.py --only conv_pointwise_half --out "$OUT" > "$OUT/pointwise.log" 2>&1) &
(timeout 420 python3 benchmarks/corpus/measure_corpus.py --out "$OUT/fp16_settled" --ids "$FP16" --budget-s 400 \
   --fresh --concurrency 8 > "$OUT/fp16.log" 2>&1) &
(timeout 300 python3 benchmarks/estimate/diagnose_gap.py --cases probe_cases.py --out "$OUT" -j 5 \
   > "$OUT/probes.log" 2>&1) &
wait
(timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_estimate.py tests/test_trace.py \
   tests/test_workload.py > "$OUT/gpu_tests.log" 2>&1)
tail -n 2 "$OUT/pointwise.log" "$OUT/fp16.log"; tail -n 6 "$OUT/probes.log"; tail -n 4 "$OUT/gpu_tests.log"
