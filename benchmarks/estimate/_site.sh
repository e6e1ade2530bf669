# Sourced by the device scripts, from the repository root: the carried wheels (.whl/, when there are any: the
# corpus's model libraries the device lacks) installed into /tmp/site, PYTHONPATH set to them and src, and the card,
# torch and cuDNN versions written to $OUT/card.txt (what every result is filed under).
if ls .whl/*.whl >/dev/null 2>&1; then
  # once per machine: a script sourced again by the scripts it starts (device_zoo.sh) finds them there
  if [ ! -e /tmp/site/.installed ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    touch /tmp/site/.installed
  fi
  export PYTHONPATH=/tmp/site:$PWD/src
else
  export PYTHONPATH=$PWD/src
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/card.txt"
python3 -c "import torch; print(torch.__version__, torch.backends.cudnn.version())" >> "$OUT/card.txt"

# The GPU tests of some test files within $2 seconds: $OUT/$1.log, the card appended.
gpu_test_files() {
  local log=$1 seconds=$2; shift 2
  timeout "$seconds" python3 -m pytest -q -m "gpu and not multigpu" "$@" -p no:cacheprovider > "$OUT/$log.log" 2>&1
  tail -n 5 "$OUT/$log.log"; cat "$OUT/card.txt" >> "$OUT/$log.log"
}

# A fresh draw's entries $3 (comma-separated) measured by device_zoo.sh from its committed predictions $1, the
# results folder named for $2 (ZOO_BUDGET_S seconds, default 520; ZOO_DONE resumes an earlier call's folder;
# ZOO_RESERVE_GIB leaves GPU memory to a draw measured beside it). Any session's device script can call it as
#   draw) draw_measurements "$2" "$3" "$4" ;;   # draw COVERAGE_JSON KIND NAMES
draw_measurements() {
  ZOO_COVERAGE=$1 ZOO_KIND=$2 ZOO_BUDGET_S=${ZOO_BUDGET_S:-520} bash benchmarks/estimate/device_zoo.sh "$3"
}

# The GPU tests (one GPU) within $1 seconds: $OUT/gpu_tests.log, the card appended.
gpu_tests() {
  gpu_test_files gpu_tests "$1" tests --ignore=tests/test_architecture.py
}

# The comma-separated names of a deterministic draw's variants: benchmarks/zoo/deterministic.py's steps of draw $1
# ("" for the fourteenth, fresh, sixteenth, seventeenth), each with the prefix $2 (det, det2, det3, det4).
deterministic_names() {
  python3 benchmarks/zoo/deterministic.py ${1:+"$1"} | tr ',' '\n' | sed "s/^/$2_/" | paste -sd,
}

# calibrate_cudnn.py's families $2.. one after another within $1 seconds (150 s each at most) with the flags in
# $GRID_FLAGS, into $OUT/calibration; their output in calibrate.log (calibrate_det.log with flags), what ran out of
# time or failed in calibrate.log.
cudnn_grids() {
  local seconds=$1 start=$SECONDS left; shift
  mkdir -p "$OUT/calibration"
  for family in "$@"; do
    left=$((seconds - (SECONDS - start)))
    if [ $left -lt 30 ]; then echo "$family ${GRID_FLAGS:-}: no time left" >> "$OUT/calibration/calibrate.log"; continue; fi
    timeout $((left < 150 ? left : 150)) python3 benchmarks/calibrate_cudnn.py ${GRID_FLAGS:-} --only "$family" \
      --out "$OUT/calibration" >> "$OUT/calibration/calibrate${GRID_FLAGS:+_det}.log" 2>&1 \
      || echo "$family ${GRID_FLAGS:-}: rc $?" >> "$OUT/calibration/calibrate.log"
  done
}
