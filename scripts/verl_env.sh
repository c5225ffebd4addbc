#!/usr/bin/env bash
# A virtualenv with verl 0.9.1 from PyPI, for tests/test_verl_parity.py: every probe key carrying a verl name
# is checked against verl's own rollout-correction functions (verl/trainer/ppo/rollout_corr_helper.py).
#
#   scripts/verl_env.sh --install     # create VERL_VENV (default .verl-venv/) unless it already imports verl
#
# verl's full dependency set (vLLM, flash-attn, CUDA builds) does not install on a CPU machine and is not
# needed: verl goes in with --no-deps, then only what importing its rollout_corr_helper needs, at verl's pins.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VERL_VENV:-$ROOT/.verl-venv}"
VERL_VERSION="${VERL_VERSION:-0.9.1}"
PY="$VENV/bin/python"

probe_import() {
    # From an empty folder: a folder named like a package in the working directory (e.g. /tmp/ray) shadows it.
    (cd "$(mktemp -d)" && "$PY" -c "import verl.trainer.ppo.rollout_corr_helper, verl; print('verl', verl.__version__)")
}

if [[ "${1:-}" != "--install" ]]; then
    sed -n '2,8p' "$0" >&2
    exit 2
fi
[[ -x "$PY" ]] && probe_import 2>/dev/null && exit 0
python3 -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip
# torch first, pinned: the CPU build; any looser spec pulls CUDA wheels.
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q --no-deps "verl==$VERL_VERSION"
"$PY" -m pip install -q torch==2.13.0 packaging numpy omegaconf codetiming ray \
    "tensordict>=0.8.0,<=0.10.0,!=0.9.0" "transformers>=5.5.3,<5.11,!=5.6.0"
probe_import
