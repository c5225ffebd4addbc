#!/usr/bin/env bash
# The GPU lane: probe's real engines on CUDA, in the environment the GPU box already has (docs/gpu.md).
#
#   scripts/gpu_check.sh [OUT]        # default OUT: gpu-check/
#
# Runs, each step logged to OUT/<step>.log and never stopping the ones after it:
#   env     `probe env` (versions, GPUs, which engines run here)
#   tests   the tests marked gpu (hf and megatron on cuda: bf16, fp32, R3, repeated passes; the Recorder with
#           CUDA tensors), plus the version-range tests (run format across pyarrow versions, CLI help, env,
#           megatron shims)
#   demo    `probe demo --num-prompts 32`, timed, then `probe doctor` and `probe gate` on its MoE run
#   bench   benchmarks/bench_gpu.py: hf generate and hf/megatron rescore tokens/s against plain transformers
# and prints the figures table (also OUT/figures.md). Exit status: 1 if any step failed.
#
# Packages the box lacks (e.g. polars, megatron-core) can be carried as wheels in .whl/ (docs/gpu.md): they are
# installed with --no-deps into a folder of their own, so the box's torch and everything else stay as they are.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-gpu-check}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/probe-site .whl/*.whl
    export PYTHONPATH="/tmp/probe-site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! (cd / && "$PY" -c "import mismatch_probe" 2>/dev/null); then
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # not installed: run from this checkout
fi
probe() { "$PY" -m mismatch_probe "$@"; }
DEMO="$(mktemp -d)/demo"
status=0
rows=()

step() {  # step NAME COMMAND...: run, log, record its wall time and outcome
    local name=$1
    shift
    local start end rc
    start=$(date +%s.%N)
    "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    end=$(date +%s.%N)
    local seconds
    seconds=$(awk -v a="$start" -v b="$end" 'BEGIN {printf "%.1f", b - a}')
    rows+=("| $name | $([ $rc -eq 0 ] && echo ok || echo "FAILED (exit $rc)") | $seconds s |")
    [ $rc -eq 0 ] || status=1
    echo "== $name: exit $rc, $seconds s"
    tail -n 5 "$OUT/$name.log"
}

demo() {
    probe demo --out "$DEMO" --num-prompts "${DEMO_PROMPTS:-32}" &&
        probe doctor "$DEMO/moe" &&
        probe gate "$DEMO/moe" --max k3_kl=1 &&
        cp "$DEMO/moe/report/metrics.json" "$OUT/demo-moe-metrics.json"
}

step env probe env
step tests "$PY" -m pytest -q -s -p no:cacheprovider -m "gpu or not slow" tests/test_gpu.py tests/test_gpu_quant.py tests/test_run_format.py \
    tests/test_schema.py tests/test_help_flags.py tests/test_env.py tests/test_megatron_shims.py
step demo demo
# shellcheck disable=SC2086  # BENCH_ARGS: extra flags, word-split on purpose
step bench "$PY" benchmarks/bench_gpu.py --markdown "$OUT/bench.md" ${BENCH_ARGS:-}

{
    echo "# scripts/gpu_check.sh, $(date -u +%Y-%m-%dT%H:%MZ)"
    echo
    "$PY" -c "import torch; print('device:', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device', '| torch', torch.__version__)"
    echo
    echo "| step | outcome | wall time |"
    echo "|---|---|---|"
    printf '%s\n' "${rows[@]}"
    echo
    [ -f "$OUT/bench.md" ] && tail -n +3 "$OUT/bench.md"
} >"$OUT/figures.md"
cat "$OUT/figures.md"
exit "$status"
