# Sourced by the device scripts, from the repository root: the carried wheels (.whl/, when there are any: the
# corpus's model libraries the device lacks) installed into /tmp/site, PYTHONPATH set to them and src, and the card,
# torch and cuDNN versions written to $OUT/card.txt (what every result is filed under).
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD/src
else
  export PYTHONPATH=$PWD/src
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/card.txt"
python3 -c "import torch; print(torch.__version__, torch.backends.cudnn.version())" >> "$OUT/card.txt"

# The GPU tests (one GPU) within $1 seconds: $OUT/gpu_tests.log, the card appended.
gpu_tests() {
  timeout "$1" python3 -m pytest -q -m "gpu and not multigpu" tests --ignore=tests/test_architecture.py \
    -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
  tail -n 5 "$OUT/gpu_tests.log"; cat "$OUT/card.txt" >> "$OUT/gpu_tests.log"
}
