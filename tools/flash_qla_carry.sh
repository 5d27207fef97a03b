#!/usr/bin/env bash
# Developer script: FlashQLA (PyPI flash-qla 0.1.3 on tilelang 0.1.13) for the lent GPU machine, which has no
# network and takes at most 64 MiB of carried files a call. The wheels come to about 83 MB (tilelang 50 MB, z3-solver
# 29 MB, which tilelang's compiler library links), too many for one carry beside .whl/; installed for the machine's
# Python (3.12, x86_64) without their command-line tools and packed with xz they are about 49 MB. tilelang 0.1.13, not
# newer: 0.1.14 and 0.1.15 check that a buffer is written before it is read and refuse FlashQLA's backward kernel
# (`dk_fragment`, read under `if i_s > 0` after the previous iteration wrote it; seen on an H100 with 0.1.15):
#   bash tools/flash_qla_carry.sh            # writes .carry/flash-qla-site.tar.xz (git-ignored)
# tools/h200_session.sh unpacks it to /tmp/site-qla when it is there; its `gdn` and `ab` parts put that folder on
# PYTHONPATH for the FlashQLA side (fla dispatches its delta rule to FlashQLA where flash_qla imports).
set -euo pipefail
cd "$(dirname "$0")/.."
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$W/wheels" flash-qla==0.1.3 tilelang==0.1.13 \
  "apache-tvm-ffi>=0.1.11,<0.1.13" torch-c-dlpack-ext "z3-solver>=4.13.0,<4.15.5" ml-dtypes cloudpickle psutil tqdm
python3 -m pip install -q --no-deps --target "$W/site" "${PLAT[@]}" "$W"/wheels/*.whl
rm -rf "$W/site/bin"  # z3's and tvm-ffi's command-line tools
mkdir -p .carry
tar -C "$W/site" -cf - . | xz -T0 -6 > .carry/flash-qla-site.tar.xz
ls -l .carry/flash-qla-site.tar.xz
