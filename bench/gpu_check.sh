#!/usr/bin/env bash
# The GPU checks of issue 14 as one lease's command (see /work/.library/device/README.md):
#   run: bash bench/gpu_check.sh [swap_bench args...]   with .whl carried (libcst for py3.12)
# Installs atomc into the machine's own torch, runs `pytest -m gpu`, then bench/swap_bench.py.
# Logs, the bench's JSON and its profiles and plans go to $OUT (or out/gpu_check here), packed
# into one gpu_check.tgz at the end.
set -u
OUT=${OUT:-out/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
    || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__)'
# shellcheck disable=SC2086 # GPU_TESTS: several paths
timeout "${GPU_TESTS_S:-240}" python3 -m pytest -m gpu -q -s -p no:cacheprovider \
    ${GPU_TESTS:-tests/gpu tests/test_codegen.py tests/test_runtime_costs.py} 2>&1 | tee "$OUT/gpu_tests.log" \
    | grep -E "passed|failed|error|operators sum|host AdamW|FAILED|Error" | tail -40
timeout "${BENCH_S:-300}" python3 bench/swap_bench.py --out "$OUT/swap_bench.json" "$@" \
    2>&1 | tee "$OUT/swap_bench.log" | tail -60
# one archive: the device tool brings back only a few files of $OUT (8 on 2026-11-26)
( cd "$OUT" && tar czf ../gpu_check.tgz . && find . -mindepth 1 -delete && mv ../gpu_check.tgz . )
