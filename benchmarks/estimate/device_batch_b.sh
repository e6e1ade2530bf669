#!/usr/bin/env bash
# The session's last device call (H200): the GPU tests of the merged estimator and planner and the RNN fit-half
# entries' allocator traces side by side (memory only), then the optimizer-state check on GPT-2 alone (it times).
#   bash benchmarks/estimate/device_batch_b.sh          # carry .whl-optim (torchao wheel)
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/card.txt"
(timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_estimate.py tests/test_trace.py \
   tests/test_plan.py tests/test_speed_model_choice.py tests/test_explain.py tests/test_fake_mode.py \
   > "$OUT/gpu_tests.log" 2>&1) &
(timeout 200 python3 benchmarks/estimate/trace_entries.py c090_rnn c092_rnn c093_rnn c094_rnn c096_rnn --out "$OUT" \
   > "$OUT/trace_entries.log" 2>&1) &
wait
timeout 240 python3 benchmarks/plan/optimizer_state_device.py --workloads gpt2 --out "$OUT" > "$OUT/optimizer_state.log" 2>&1
tail -n 4 "$OUT/gpu_tests.log"; tail -n 2 "$OUT/trace_entries.log"; tail -n 12 "$OUT/optimizer_state.log"
