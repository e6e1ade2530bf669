#!/usr/bin/env bash
# Session 28's device calls (H200), from the repository root, writing under $OUT.
#   bash benchmarks/estimate/device_batch_i.sh above   # the H200's committed bisections (corpus validation half,
#       # second and third draws) checked at up to 8 caps above each answer (measure_corpus.py --check-above):
#       # fits_in is the smallest cap at and above which a step runs, and a bisection can land in a lower window.
#       # Resumable: run again with the folders it wrote copied to benchmarks/results/estimate/ (--done).
#   bash benchmarks/estimate/device_batch_i.sh above CORPUS_IDS ZOO_IDS   # only these (comma-separated; "-": none)
#       # Both folders come back in one $OUT/above_<date>.tar.gz (at most 8 files come back from a call).
#   bash benchmarks/estimate/device_batch_i.sh final   # ViT-B/16's 4 and 5 GiB plans (session 25's), their fastest
#       # contenders and a copy of each plan, 10 repeats of 20 interleaved rounds, every repeat built anew (the
#       # median of the per-repeat paired ratios); then the GPU tests
#   bash benchmarks/estimate/device_batch_i.sh tests   # the GPU tests (one GPU)
set -u
. benchmarks/estimate/_site.sh  # PYTHONPATH, $OUT/card.txt
R=benchmarks/results/estimate
case "$1" in
  above)
    day=$(date +%Y%m%d)
    corpus_ids=${2:-}; zoo_ids=${3:-}
    corpus_out=$OUT/corpus_measurements_above_h200_torch2.11_$day
    zoo_out=$OUT/zoo_holdout23_measurements_above_h200_torch2.11_$day
    # two schedulers side by side, each with half of the GPU's memory for its tickets (--reserve-gib)
    [ "$corpus_ids" != "-" ] && timeout 580 python3 benchmarks/corpus/measure_corpus.py --split validation \
      ${corpus_ids:+--ids "$corpus_ids"} --check-above 8 --concurrency 7 \
      --reserve-gib 72 --budget-s 545 --out "$corpus_out" \
      $(ls -d $R/corpus_measurements_above_h200_* 2>/dev/null | sed 's/^/--done /') \
      --done $R/corpus_measurements_h200_torch2.11_20261126 > "$OUT/above_corpus.log" 2>&1 &
    draws=$R/trace_coverage_cpu_torch2.14_20261129_draws23_h200_s27.json
    ids=$(python3 -c "import json, sys; print(','.join(r['name'] for r in json.load(open(sys.argv[1]))['rows']))" "$draws")
    [ -n "$zoo_ids" ] && ids=$zoo_ids
    [ "$ids" != "-" ] && timeout 580 python3 benchmarks/corpus/measure_corpus.py --check-above 8 --concurrency 7 --reserve-gib 72 \
      --budget-s 545 --out "$zoo_out" --zoo "$draws" --ids "$ids" \
      $(ls -d $R/zoo_holdout23_measurements_above_h200_* 2>/dev/null | sed 's/^/--done /') \
      --done $R/zoo_holdout3_measurements_r2_h200_torch2.11_20261128 \
      --done $R/zoo_holdout3_measurements_h200_torch2.11_20261128 \
      --done $R/zoo_holdout2_measurements_h200_torch2.11_20261128 > "$OUT/above_zoo.log" 2>&1 &
    wait
    for d in "$corpus_out" "$zoo_out"; do [ -d "$d" ] && cp "$OUT/card.txt" "$d/"; done
    (cd "$OUT" && tar czf "above_$day.tar.gz" $(basename "$corpus_out") $(basename "$zoo_out") 2>/dev/null; \
      rm -rf "$corpus_out" "$zoo_out")
    tail -n 2 "$OUT/above_corpus.log" "$OUT/above_zoo.log"
    ;;
  final)
    mkdir -p "$OUT/vit_control"
    timeout 240 python3 benchmarks/plan/sweep_device.py control --out "$OUT/vit_control" --budgets 5,4 --rounds 20 \
      --repeats 10 --judged benchmarks/results/plan/plan_vit5_h200_torch2.11_20261128_s25/plan_calibrated_vit_b16.json \
      > "$OUT/vit_control/control_vit_b16.log" 2>&1
    cp "$OUT/card.txt" "$OUT/vit_control/"
    grep -v "^\[" "$OUT/vit_control/control_vit_b16.log" | tail -n 4
    gpu_tests 330
    ;;
  tests)
    gpu_tests 570
    ;;
esac
