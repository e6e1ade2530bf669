#!/usr/bin/env bash
# The wheels benchmarks/integrations/nnunet_device.py needs on the device machine (CPython 3.12, x86-64), which
# has torch, numpy, scipy, scikit-image, scikit-learn, pandas, matplotlib, seaborn, tifffile, requests, einops,
# timm, msgpack, httpx and pynvml but no nnU-Net (/work/.library/device/KINDS.md's package list). About 17 MB.
# SimpleITK is left out (a 53 MB wheel, over what travels): the benchmark reads NIfTI with nibabel and stands in
# for SimpleITK's module-level imports. imagecodecs, yacs, graphviz, future and unittest2 (nnU-Net's and
# batchgenerators' declared dependencies) are not imported on the benchmark's path (checked on CPU with them
# blocked).
#
#   bash benchmarks/integrations/nnunet_wheels.sh            # into .whl/ (git-ignored), then on the device:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
set -euo pipefail
dest=${1:-.whl}
mkdir -p "$dest"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dest" \
    nnunetv2==2.8.1 dynamic_network_architectures==0.4.4 batchgenerators==0.25.5 batchgeneratorsv2==0.3.6 \
    nibabel==5.4.2 blosc2==4.14.1 ndindex==1.10.1 numexpr==2.14.2 connected-components-3d==4.1.1
# acvl_utils publishes a source archive only: build its pure-Python wheel here
python3 -m pip wheel -q --no-deps acvl_utils==0.2.6 -w "$dest"
du -sh "$dest"
