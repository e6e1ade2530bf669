#!/usr/bin/env bash
# One device call (H200) of the estimator's measurements for this session, memory only (no timings), side by side:
# 3-D convolutions beyond the calibrated size, every allocation of cuDNN RNN calls, and the GPU tests of the
# estimator and planner. Run from the repository root; writes under $OUT.
#   bash benchmarks/estimate/device_batch_a.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/card.txt"
python3 -c "import torch; print(torch.__version__, torch.backends.cudnn.version())" >> "$OUT/card.txt"
(timeout 240 python3 benchmarks/calibrate_cudnn.py --only conv_3d_xl --out "$OUT" > "$OUT/conv_3d_xl.log" 2>&1) &
(timeout 300 python3 benchmarks/estimate/rnn_allocations.py > "$OUT/rnn_allocations.log" 2>&1) &
(timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_estimate.py tests/test_trace.py \
   tests/test_plan.py tests/test_speed_model_choice.py tests/test_explain.py tests/test_fake_mode.py \
   > "$OUT/gpu_tests.log" 2>&1) &
wait
tail -2 "$OUT/conv_3d_xl.log" "$OUT/rnn_allocations.log"; tail -8 "$OUT/gpu_tests.log"
