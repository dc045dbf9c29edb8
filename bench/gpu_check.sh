#!/usr/bin/env bash
# The device check (bench/gpu_check.py) on a lent GPU machine: install the carried peer wheels
# (.whl/: Liger-Kernel, Cut Cross-Entropy; bench/RESULTS.md, "Pending GPU measurements") where
# they travelled, then run the script under an 8-minute timeout, its log beside its table in $OUT.
#
#     bash bench/gpu_check.sh                  # arguments go to gpu_check.py (--parts a,d, ...)
#     PYTHON=.venv/bin/python bash bench/gpu_check.sh --dry    # here, on the CPU
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
    "${PYTHON:-python3}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export OUT=${OUT:-/tmp/gpu_check}  # the device tool sets OUT: what is there comes back
mkdir -p "$OUT"
timeout -k 10 480 "${PYTHON:-python3}" bench/gpu_check.py "$@" 2>&1 | tee "$OUT/gpu_check.log"
