#!/usr/bin/env bash
# The per-rank report on every GPU of one host (issue 16, part 4): a clean DDP run through TrainStep and the
# balanced sampler with rank 1 capped, a planted stray context, planted uneven batch shapes (torchrun, one process
# per GPU), and nn.DataParallel in one process. Writes under $OUT: ranks_<scenario>.json for each run,
# rank_report_<machine>_torch<X.Y>_<date>.{json,md} (all runs: per-rank tables, diagnoses, expected vs named), and
# ranks_device.log. About 2-3 minutes on 2 or 4 H100s. Run from the repository root:
#   bash benchmarks/distributed/ranks_device.sh          # all GPUs of the host
#   bash benchmarks/distributed/ranks_device.sh 2        # the first 2
set -u
gpus=${1:-$(nvidia-smi -L | wc -l)}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
# NVLink multicast stays off on these hosts (device KINDS.md): also for the processes torchrun starts
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((gpus - 1)))
out=${OUT:?set OUT to the folder for the results}
log=$out/ranks_device.log
script=benchmarks/distributed/rank_report.py
python3 -c "import pynvml; pynvml.nvmlInit(); print('NVML', pynvml.nvmlSystemGetDriverVersion())" >>"$log" 2>&1 \
  || echo "pynvml missing: the report cannot list processes per GPU" | tee -a "$log"
for scenario in clean stray_context uneven_shapes; do
  timeout 150 torchrun --standalone --nproc-per-node "$gpus" "$script" --scenario "$scenario" --out "$out" \
    >>"$log" 2>&1 || echo "$scenario failed (exit $?), see ranks_device.log" | tee -a "$log"
done
timeout 120 python3 "$script" --scenario data_parallel --out "$out" >>"$log" 2>&1 \
  || echo "data_parallel failed (exit $?), see ranks_device.log" | tee -a "$log"
python3 "$script" --summarize --out "$out" 2>&1 | tee -a "$log"
