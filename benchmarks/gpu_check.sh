#!/usr/bin/env bash
# The GPU check in one command, as a session with the device machine (one H200) runs it.
#
#  1. Here, on a machine with PyPI, once:  bash benchmarks/gpu_check.sh prepare
#     downloads into .whl/ (git-ignored) the wheels the GPU image lacks: trl, datasets, dill,
#     multiprocess (~3 MB). `prepare --with-bnb` adds bitsandbytes (~43 MB: the working tree and the
#     wheels must stay under the device tool's 64 MiB, so check `du -sh .whl` + the tree first).
#  2. Device run:  command "bash benchmarks/gpu_check.sh", carry [".whl"], timeout_s 600.
#     It installs the wheels into /tmp/site, runs benchmarks/gpu_check.py under a hard timeout
#     (default 560 s, the script itself stops starting runs after --budget-s 450 s), and copies
#     gpu_check.{json,md,png} to $OUT (what comes back) as well as benchmarks/results/.
#  Extra arguments go to gpu_check.py, e.g. `bash benchmarks/gpu_check.sh --shapes 0.5b --no-vllm`.
#  Environment: GPU_CHECK_TIMEOUT_S (hard limit, default 560), GPU_CHECK_BUDGET_S (default 450).
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "prepare" ]; then
    shift
    packages=(trl==1.16.0 "datasets==${DATASETS_VERSION:-5.2.0}" dill==0.4.1 multiprocess==0.70.19)
    if [ "${1:-}" = "--with-bnb" ]; then packages+=(bitsandbytes); fi
    mkdir -p .whl
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
        -d .whl "${packages[@]}" || exit 1
    du -sh .whl
    exit 0
fi

LIMIT=${GPU_CHECK_TIMEOUT_S:-560}
BUDGET=${GPU_CHECK_BUDGET_S:-450}
start=$(date +%s)
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "gpu_check.sh: installing .whl/*.whl failed" >&2; exit 3; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -c "import trl, datasets, grpo_variants" || {
    echo "gpu_check.sh: trl/datasets not importable: run 'bash benchmarks/gpu_check.sh prepare' on a machine with PyPI and carry .whl" >&2
    exit 3
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
left=$(( LIMIT - ($(date +%s) - start) ))
timeout --signal=TERM --kill-after=20 "$left" python3 benchmarks/gpu_check.py --budget-s "$BUDGET" "$@"
rc=$?
[ $rc -eq 124 ] && echo "gpu_check.sh: hard timeout after ${LIMIT} s; partial results were written after each run" >&2
if [ -n "${OUT:-}" ]; then
    cp benchmarks/results/gpu_check.json benchmarks/results/gpu_check.md benchmarks/results/gpu_check.png "$OUT"/ 2>/dev/null
fi
exit $rc
