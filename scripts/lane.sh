#!/usr/bin/env bash
# A CI lane that proves a set of dependency versions: the probe installed in its own virtualenv at those
# versions, `probe --help` and `probe env` as a user starts, then the lane subset of the tests (`pytest -m lane`:
# every use of each declared dependency, docs/development.md says which tests carry it), on 2 workers, and a
# tiny `probe demo` with report and gate on its runs.
#
#   scripts/lane.sh lowest      # every direct dependency at the floor pyproject.toml declares (.venv-lowest/)
#   scripts/lane.sh gpu-image   # the versions of our users' GPU image, scripts/lanes/gpu-image.txt (.venv-gpu-image/)
#
# lowest: the pins are generated from pyproject.toml by scripts/lowest_pins.py on every install, never
# copied. gpu-image: the pins file is installed as well as constraining (the image has accelerate).
# In both, torch is the CPU build 2.13.0 (any other torch spec pulls GBs of CUDA wheels), installed first.
# The virtualenv is reused while pyproject.toml, the pins and this script are unchanged (a stamp holds
# their hash). Every step runs; the exit status is 1 when any failed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LANE="${1:-}"
case "$LANE" in
    # SGLang 0.5.23 (for the sglang-offline tests) declares transformers==5.19.0 and fails to import on the
    # floor's transformers: left out, those tests skip.
    lowest) WITH_SGLANG=0 ;;
    gpu-image) WITH_SGLANG=1 ;;
    *)
        sed -n '4,6p' "$0" >&2
        exit 2
        ;;
esac
VENV="$ROOT/.venv-$LANE"
PY="$VENV/bin/python"
PROBE="$VENV/bin/probe"
STAMP="$VENV/.installed"
PINS="$VENV/pins.txt"
TORCH="torch==2.13.0"
# The extras installed besides [test,megatron]: [ray] and [remote] resolve at both lanes' pins.
EXTRAS="test,megatron,ray,remote"
# What the Makefile installs for the sglang-offline tests (SGLang's ServerArgs, without its dependencies).
SGLANG=(sglang==0.5.23)
SGLANG_IMPORTS=(orjson==3.13.0 pybase64==1.5.1 triton==3.9.0 starlette==1.10.0 msgspec==0.22.0 aiohttp==3.14.5)
# The packages whose versions the lane exists to prove, printed from pip freeze.
KEY="typer|click|rich|pyarrow|transformers|tokenizers|safetensors|polars|numpy|matplotlib|jinja2|requests|megatron-core|accelerate|torch|huggingface[-_]hub"

cd "$ROOT"
step() { echo "lane $LANE [${SECONDS}s]: $*"; }
status=0
timings=()
mark() { timings+=("$1 $(($SECONDS - $2))s"); }

pins_source() {
    if [ "$LANE" = lowest ]; then echo "pyproject.toml"; else echo "scripts/lanes/$LANE.txt"; fi
}
fingerprint() { cat pyproject.toml "$(pins_source)" "$0" scripts/lowest_pins.py | sha256sum | cut -d' ' -f1; }

install() {
    step "fresh virtualenv $VENV"
    python3 -m venv --clear "$VENV"
    "$PY" -m pip install -q "$TORCH"
    if [ "$LANE" = lowest ]; then
        "$PY" -m pip install -q packaging
        "$PY" scripts/lowest_pins.py >"$PINS"
    else
        cp "scripts/lanes/$LANE.txt" "$PINS"
    fi
    echo "$TORCH" >>"$PINS"
    step "constraints:"
    grep -v '^#' "$PINS" | sed 's/^/    /'
    local extra=()
    [ "$LANE" = gpu-image ] && extra=(-r "$PINS")
    "$PY" -m pip install -q -e ".[$EXTRAS]" "${extra[@]}" -c "$PINS"
    if [ "$WITH_SGLANG" = 1 ]; then
        "$PY" -m pip install -q --no-deps "${SGLANG[@]}" -c "$PINS"
        "$PY" -m pip install -q "${SGLANG_IMPORTS[@]}" -c "$PINS"
    fi
    fingerprint >"$STAMP"
}

start=$SECONDS
if [ -x "$PY" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(fingerprint)" ]; then
    step "reusing $VENV (pyproject.toml, pins and this script unchanged)"
else
    install
fi
mark install "$start"
step "versions:"
"$PY" -m pip freeze 2>/dev/null | grep -iE "^($KEY)(==| @)" | sed 's/^/    /'
# What is imported, not only what is recorded: typer and typer-slim write the same files.
"$PY" -c "import typer, click; print(f'    imported: typer {typer.__version__}, click {click.__version__}')" || status=1
# Every constraint must have been met: a pin that pip could not honour would make the lane prove nothing.
"$PY" - "$PINS" <<'EOF' || status=1
import sys
from importlib.metadata import PackageNotFoundError, version

from packaging.requirements import Requirement

bad = []
for line in open(sys.argv[1], encoding="utf-8"):
    line = line.split("#")[0].strip()
    if not line:
        continue
    requirement = Requirement(line)
    try:
        installed = version(requirement.name)
    except PackageNotFoundError:
        continue  # a constraint only: nothing in this lane needs it
    if not requirement.specifier.contains(installed, prereleases=True):
        bad.append(f"{requirement.name} {installed} is installed, the lane pins {requirement.specifier}")
print("\n".join(f"lane: {line}" for line in bad) or "lane: every pin is installed as pinned")
sys.exit(1 if bad else 0)
EOF

step "probe --help and probe env, as a user starts"
"$PROBE" --help >/dev/null || status=1
"$PROBE" env || status=1

start=$SECONDS
step "the lane subset: pytest -m lane"
"$PY" -m pytest -q -m lane -n 2 --dist loadfile -p no:cacheprovider --tb=short -rfEs || status=$?
mark "lane tests" "$start"

start=$SECONDS
DEMO="$VENV/demo-run"
rm -rf "$DEMO"
step "a tiny demo into $DEMO (2 prompts, 8 tokens: every section runs, in about half a minute), report and gate"
"$PROBE" demo --out "$DEMO" --num-prompts 2 --max-new-tokens 8 || status=1
# Each run the demo left, even when it failed part-way: one failing run still has the other reported.
for run in "$DEMO"/moe "$DEMO"/dense; do
    if [ -d "$run" ]; then
        "$PROBE" report "$run" >/dev/null || status=1
        "$PROBE" gate "$run" --max k3_kl=10 || status=1
    else
        echo "lane: the demo left no run $run" >&2
        status=1
    fi
done
mark demo "$start"

step "done, exit $status; wall time: ${timings[*]}"
exit "$status"
