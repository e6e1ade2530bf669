#!/usr/bin/env bash
# Session 36's device calls (H200), from the repository root, writing under $OUT.
#   bash benchmarks/estimate/device_batch_o.sh op_blocks NAME,...   # zoo steps' blocks named by the op that took
#       # them (op_blocks.py run), side by side on the one GPU
#   bash benchmarks/estimate/device_batch_o.sh holdout10 NAMES   # the tenth draw measured (peaks and the smallest
#       # cap that runs, device_zoo.sh) from its committed predictions; ZOO_DONE=FOLDER resumes an earlier call's
#   bash benchmarks/estimate/device_batch_o.sh holdout11 NAMES   # the eleventh draw, the same way
#   bash benchmarks/estimate/device_batch_o.sh misses NAME,... MEASURE,...   # zoo steps' blocks by op (op_blocks.py)
#       # and their uncapped allocator streams (trace_entries.py --zoo), side by side; and `memfit measure` (peaks and
#       # the smallest cap that runs) of the MEASURE steps
#   bash benchmarks/estimate/device_batch_o.sh caps NAME=CAP,CAP NAME=CAP,...   # each zoo step run three times under
#       # each cap (cap_repeats.py), the steps side by side
#   bash benchmarks/estimate/device_batch_o.sh grid SET   # conv_grid.py --cases SET
#   bash benchmarks/estimate/device_batch_o.sh tests   # the GPU tests (one GPU)
set -u
. benchmarks/estimate/_site.sh  # PYTHONPATH, $OUT/card.txt, gpu_tests, gpu_test_files, draw_measurements

case "$1" in
  op_blocks)
    timeout 560 python3 benchmarks/estimate/op_blocks.py run "$2" --out "$OUT" > "$OUT/op_blocks.log" 2>&1
    tail -n 20 "$OUT/op_blocks.log"
    ;;
  holdout10)
    draw_measurements benchmarks/results/estimate/trace_coverage_cpu_torch2.14_20261130_holdout10_h200_s36.json \
      zoo_holdout10_measurements "$2"
    ;;
  holdout11)
    draw_measurements benchmarks/results/estimate/trace_coverage_cpu_torch2.14_20261130_holdout11_h200_s36.json \
      zoo_holdout11_measurements "$2"
    ;;
  misses)
    timeout 300 python3 benchmarks/estimate/op_blocks.py run "$2" --out "$OUT" > "$OUT/op_blocks.log" 2>&1 &
    timeout 400 python3 benchmarks/estimate/trace_entries.py --zoo ${2//,/ } --out "$OUT" > "$OUT/streams.log" 2>&1 &
    for name in ${3//,/ }; do
      spec=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks/zoo'); from registry import entries; print(entries(['$name'])[0].spec)")
      timeout 500 python3 -m memfit.cli measure "$spec" --json > "$OUT/measure_$name.json" 2> "$OUT/measure_$name.log" &
    done
    wait
    tail -n 4 "$OUT/op_blocks.log" "$OUT/streams.log"; head -c 600 "$OUT"/measure_*.json
    ;;
  caps)
    shift
    for arg in "$@"; do
      timeout 500 python3 benchmarks/estimate/cap_repeats.py "${arg%%=*}" --caps "${arg#*=}" --repeats 3 --jobs 3 \
        --out "$OUT/cap_repeats_${arg%%=*}.json" > "$OUT/cap_repeats_${arg%%=*}.log" 2>&1 &
    done
    wait
    tail -n 3 "$OUT"/cap_repeats_*.log
    ;;
  grid)
    timeout 560 python3 benchmarks/estimate/conv_grid.py --cases "$2" --out "$OUT" --budget-s 500 \
      > "$OUT/grid_$2.log" 2>&1
    tail -n 2 "$OUT/grid_$2.log" | cut -c1-300
    ;;
  tests)
    gpu_tests 570
    ;;
esac
