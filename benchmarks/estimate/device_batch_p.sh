#!/usr/bin/env bash
# Session 37's device calls (H200), from the repository root, writing under $OUT.
#   bash benchmarks/estimate/device_batch_p.sh allocator GROUP[,GROUP]   # the twelfth draw (zoo/allocator_draw.py):
#       # each group's steps measured (peaks and the smallest cap that runs) under its PYTORCH_CUDA_ALLOC_CONF, from
#       # its committed predictions; two groups side by side, each leaving the other half of the GPU
#   bash benchmarks/estimate/device_batch_p.sh draw COVERAGE_JSON KIND NAMES   # any fresh draw, the same way
#       # (ZOO_EXTRA=--no-floor: steps that take what memory they are given, the thirteenth draw's cudnn.benchmark)
#   bash benchmarks/estimate/device_batch_p.sh tests   # the GPU tests (one GPU)
#   bash benchmarks/estimate/device_batch_p.sh measure_tests NAME   # `memfit measure NAME --json` (a zoo step) beside
#       # the GPU tests, on one GPU
set -u
. benchmarks/estimate/_site.sh  # PYTHONPATH, $OUT/card.txt, gpu_tests, draw_measurements

case "$1" in
  allocator)
    groups=(${2//,/ })
    reserve=6
    if [ ${#groups[@]} -gt 1 ]; then reserve=72; fi  # of the H200's 140 GiB: ~68 for each of two groups
    for group in "${groups[@]}"; do
      line=$(python3 benchmarks/zoo/allocator_draw.py | grep "^$group"$'\t')
      conf=$(cut -f2 <<< "$line"); names=$(cut -f3 <<< "$line")
      PYTORCH_CUDA_ALLOC_CONF=$conf ZOO_RESERVE_GIB=$reserve ZOO_BUDGET_S=${ZOO_BUDGET_S:-500} draw_measurements \
        "benchmarks/results/estimate/trace_coverage_cpu_torch2.14_20261130_allocator_${group}_h200_s37.json" \
        "zoo_allocator_${group}_measurements" "$names" &
    done
    wait
    ;;
  draw)
    draw_measurements "$2" "$3" "$4"
    ;;
  tests)
    gpu_tests 570
    ;;
  measure_tests)
    spec=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks/zoo'); from registry import entries; print(entries(['$2'])[0].spec)")
    timeout 540 python3 -m memfit.cli measure "$spec" --json > "$OUT/measure_$2.json" 2> "$OUT/measure_$2.log" &
    gpu_tests 560
    wait
    python3 -c "import json; m = json.load(open('$OUT/measure_$2.json')); print({k: m[k] for k in ('peak_allocated_bytes', 'fits_in_bytes', 'cudnn_benchmark')}, len(m['trials']), 'trials')"
    ;;
esac
