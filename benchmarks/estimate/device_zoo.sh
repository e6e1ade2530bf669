#!/usr/bin/env bash
# The zoo measured on the GPU (memory only, trials side by side): every entry's peaks first (one trial each), then
# the smallest cap that runs, entry by entry in the zoo's seeded order, until the budget ends. Run from the
# repository root with .whl carried (MONAI, smp, nnU-Net's networks); writes under $OUT, and packs the results
# folder into one archive (a call brings back a limited number of files).
#   bash benchmarks/estimate/device_zoo.sh                 # first call: peaks of all, then bisection
#   bash benchmarks/estimate/device_zoo.sh NAME,NAME,...   # later calls: the bisection of the entries left
#                                                          # (ZOO_BUDGET_S seconds, default 490; it goes on from
#                                                          # the committed folder's partial entries)
#   ZOO_COVERAGE=PATH ZOO_KIND=zoo_holdout_measurements bash benchmarks/estimate/device_zoo.sh NAME,...
#                                                          # another trace_coverage.py result (a fresh draw's);
#                                                          # ZOO_DONE=FOLDER resumes from an earlier call's
# ZOO_RESERVE_GIB (default 6): GPU memory no trial may take; two draws measured side by side each leave the other
# its share. Logs are named for ZOO_KIND.
set -u
. benchmarks/estimate/_site.sh
COVERAGE=${ZOO_COVERAGE:-benchmarks/results/estimate/trace_coverage_cpu_torch2.14_20261127.json}
DEST="$OUT/$(python3 -c "
import sys, torch; sys.path.insert(0, 'benchmarks'); from _results import card, stem
print(stem('${ZOO_KIND:-zoo_measurements}', card(torch.cuda.get_device_name(0)), torch.__version__))")"
COMMON=(--zoo "$COVERAGE" --out "$DEST" --concurrency 12 --reserve-gib "${ZOO_RESERVE_GIB:-6}")
LOG="$OUT/${ZOO_KIND:-zoo}"
if [ -n "${ZOO_DONE:-}" ]; then COMMON+=(--done "$ZOO_DONE"); fi  # an earlier call's folder, committed
if [ -n "${ZOO_EXTRA:-}" ]; then COMMON+=($ZOO_EXTRA); fi  # more measure_corpus.py options (--no-floor)
if [ $# -ge 1 ]; then  # $1: the entries left, comma-separated
  BUDGET=${ZOO_BUDGET_S:-490}
  timeout $((BUDGET + 30)) python3 benchmarks/corpus/measure_corpus.py "${COMMON[@]}" --ids "$1" --budget-s "$BUDGET" \
    > "${LOG}_bisect.log" 2>&1
else
  timeout 300 python3 benchmarks/corpus/measure_corpus.py "${COMMON[@]}" --no-bisect --budget-s 270 \
    > "${LOG}_peaks.log" 2>&1
  tail -n 5 "${LOG}_peaks.log"
  timeout 290 python3 benchmarks/corpus/measure_corpus.py "${COMMON[@]}" --budget-s 260 > "${LOG}_bisect.log" 2>&1
fi
tail -n 12 "${LOG}_bisect.log"
tar czf "$DEST.tar.gz" -C "$OUT" "$(basename "$DEST")" && rm -rf "$DEST"
