#!/usr/bin/env bash
# One device call (memory only, side by side): the fit-side supplement drawn by the corpus's generator with
# another seed (probe_cases.py: 16 RNN steps, 6 fp16 torchvision classifiers), each run uncapped with its
# allocator stream and bisected to its smallest cap. Run from the repository root; writes under $OUT.
#   bash benchmarks/estimate/device_batch_e.sh               # the third round: every s1327_* probe
#   bash benchmarks/estimate/device_batch_e.sh 'gru_lm|regnet'  # the fourth: names matching the pattern
set -u
PATTERN=${1:-^s1327}
. benchmarks/estimate/_site.sh
ONLY=$(python3 -c "
import sys; sys.path[:0] = ['benchmarks/estimate', 'benchmarks/corpus']
import re, probe_cases; print(','.join(k for k in probe_cases.PROBES if re.search(r'$PATTERN', k)))")
timeout 560 python3 benchmarks/estimate/diagnose_gap.py --cases probe_cases.py --only "$ONLY" --out "$OUT" -j 11 \
   > "$OUT/supplement.log" 2>&1
tail -n 25 "$OUT/supplement.log"
