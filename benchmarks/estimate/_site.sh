# Sourced by this folder's device scripts, from the repository root: the carried wheels (.whl/, when there are
# any: the corpus's model libraries the device lacks) installed into /tmp/site, and PYTHONPATH set to them and src.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD/src
else
  export PYTHONPATH=$PWD/src
fi
export PYTHONUNBUFFERED=1
