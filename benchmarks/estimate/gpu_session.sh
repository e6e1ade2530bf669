#!/usr/bin/env bash
# One device call for the estimator work of a session: finish the corpus measurements (resuming from the committed
# folder), then the GPU tests of the estimator and the planner. Writes under $OUT; run from the repository root:
#   bash benchmarks/estimate/gpu_session.sh 330     # seconds for the corpus
set -u
corpus_s=${1:-330}
. benchmarks/estimate/_site.sh
done_dir=$(ls -d benchmarks/results/estimate/corpus_measurements_*_torch*_* 2>/dev/null | tail -1)
python3 benchmarks/corpus/measure_corpus.py --out /tmp/corpus ${done_dir:+--done $done_dir} --budget-s "$corpus_s" \
  --concurrency 10 > "$OUT/corpus.log" 2>&1
tail -2 "$OUT/corpus.log"
tar czf "$OUT/corpus_more.tar.gz" -C /tmp corpus
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_plan.py tests/test_estimate.py tests/test_trace.py \
  > "$OUT/gpu_tests.log" 2>&1
tail -5 "$OUT/gpu_tests.log"
