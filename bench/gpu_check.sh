#!/usr/bin/env bash
# The GPU checks as one lease's command (see /work/.library/device/README.md):
#   run: bash bench/gpu_check.sh [bench args...]   with .whl carried (libcst for py3.12)
# Installs atomc into the machine's own torch, runs `pytest -m gpu`, then the benchmark that
# BENCH names (bench/$BENCH.py, default swap_bench) with the args given.
# Logs, the bench's JSON and its profiles and plans go to $OUT (or out/gpu_check here), packed
# into one gpu_check.tgz at the end.
#
# The side-by-side benchmark of issue 32 (atomc against resident, FSDP2 CPU offload, MegaTrain
# and DeepSpeed), sized to fit one 10-minute command inside a 15-minute lease (about 9 minutes
# of command after a 1-2 minute start):
#   carry: [".whl", "bench/vendor"]
#   command: BENCH=side_by_side GPU_TESTS_S=120 BENCH_S=420 bash bench/gpu_check.sh \
#            --configs llama-1.3b --gpu-mem 8GiB --warmup 1 --steps 3 --calibrate-steps 3
# llama-2.7b needs a lease of its own (same command with --configs llama-2.7b --gpu-mem 10GiB,
# GPU_TESTS=none). bench/vendor/MegaTrain is MegaTrain's checkout (bench/megatrain_driver.py
# says how to make it); without it the MegaTrain row says why it was skipped. DeepSpeed runs when
# .whl also holds a wheel of it and its needs; here, once (PyPI has only its source archive):
#   python -m pip download deepspeed==0.19.8 --no-deps --no-binary=:all: -d /tmp/ds
#   DS_BUILD_OPS=0 python -m pip wheel --no-deps --no-build-isolation -w .whl \
#       /tmp/ds/deepspeed-0.19.8.tar.gz          # a py3-none-any wheel; ops compile at first use
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 -d .whl hjson==3.1.0 pydantic==2.14.3 \
#       pydantic-core==2.50.4 annotated-types typing-inspection typing-extensions==4.16.0
# Its CPU Adam then compiles on the GPU machine at first use (ninja and the host compiler; a
# minute or more of the lease, unmeasured so far): in MegaTrain's set-up, which uses it as its
# own script does, and not in anyone's timed steps. The sizing above is an estimate that no
# lease has checked yet: each model's rows are printed as they finish, and a run stopped at
# BENCH_S still prints what it measured (--report on its JSON, below).
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
if [ "${GPU_TESTS:-}" != none ]; then
    # shellcheck disable=SC2086 # GPU_TESTS: several paths
    timeout "${GPU_TESTS_S:-240}" python3 -m pytest -m gpu -q -s -p no:cacheprovider \
        ${GPU_TESTS:-tests/gpu tests/codegen/test_codegen.py tests/calibrate/test_runtime_costs.py} 2>&1 \
        | tee "$OUT/gpu_tests.log" \
        | grep -E "passed|failed|error|operators sum|host AdamW|FAILED|Error" | tail -40
fi
BENCH=${BENCH:-swap_bench}
extra=()
if [ "$BENCH" = side_by_side ]; then
    [ -d bench/vendor/MegaTrain ] && extra+=(--megatrain bench/vendor/MegaTrain)
    # atomc has no H200 profile; the H200's GH100 has the H100 SXM's dense tensor peaks
    # (989 TFLOP/s bf16, 495 TF32: NVIDIA H200 datasheet), so MFU is taken against h100-80gb
    nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 \
        && extra+=(--hardware h100-80gb)
fi
timeout "${BENCH_S:-300}" python3 "bench/$BENCH.py" --out "$OUT/$BENCH.json" \
    ${extra[@]+"${extra[@]}"} "$@" 2>&1 | tee "$OUT/$BENCH.log" | tail -80
if [ "${PIPESTATUS[0]}" = 124 ] && [ "$BENCH" = side_by_side ] && [ -f "$OUT/$BENCH.json" ]; then
    echo "-- $BENCH stopped at BENCH_S=${BENCH_S:-300} s; what it had measured:"
    python3 bench/side_by_side.py --report "$OUT/$BENCH.json"
fi
# one archive: the device tool brings back only a few files of $OUT (8 on 2026-11-26)
( cd "$OUT" && tar czf ../gpu_check.tgz . && find . -mindepth 1 -delete && mv ../gpu_check.tgz . )
