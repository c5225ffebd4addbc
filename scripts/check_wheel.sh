#!/usr/bin/env bash
# The wheel as a user gets it: build it, install it into a fresh virtualenv outside the checkout
# (CPU torch first, as in a user's environment that already has its torch), and run `probe` from /tmp:
#   1. without the [megatron] extra: --version, python -m, a short demo (its megatron rescores are
#      skipped with a note), report and gate on its output, and the install message of --engine megatron;
#   2. with [megatron] added to the same virtualenv: the short demo in full.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
VENV="$WORK/venv"
PY="$VENV/bin/python"
PROBE="$VENV/bin/probe"
DEMO=(demo --num-prompts 4 --max-new-tokens 8)

fail() { echo "check_wheel: $*" >&2; exit 1; }
step() { echo "check_wheel [${SECONDS}s]: $*"; }

step "fresh virtualenv in $VENV, CPU torch, the wheel"
python3 -m venv "$VENV"
"$PY" -m pip install -q torch==2.13.0
# Build from the files git knows (tracked or not ignored): setuptools builds in-tree, and a stale
# build/ in the checkout would otherwise leak removed modules into the wheel.
mkdir "$WORK/src"
git -C "$REPO" ls-files -z -co --exclude-standard \
    | tar -C "$REPO" --null --ignore-failed-read -cf - -T - | tar -C "$WORK/src" -xf -
"$PY" -m pip wheel -q --no-deps -w "$WORK/dist" "$WORK/src"
WHEEL="$(ls "$WORK"/dist/mismatch_probe-*.whl)"
echo "wheel: $(basename "$WHEEL"), $(du -k "$WHEEL" | cut -f1) KiB"
"$PY" -m pip install -q "$WHEEL"
"$PY" -m pip show -q megatron-core 2>/dev/null && fail "megatron-core was installed without the [megatron] extra"

cd /tmp
step "without [megatron], from /tmp"
VERSION="$("$PY" -c 'import mismatch_probe; print(mismatch_probe.__version__)')"
[ "$("$PROBE" --version)" = "mismatch-probe $VERSION" ] || fail "probe --version does not print mismatch-probe $VERSION"
HELP="$("$PY" -m mismatch_probe --help)"
grep -q "Usage: probe" <<<"$HELP" || fail "python -m mismatch_probe --help is not probe's help"

"$PROBE" "${DEMO[@]}" --out "$WORK/base" 2>&1 | tee "$WORK/base.log"
grep -q "megatron-core is not installed: skipping the megatron rescores" "$WORK/base.log" \
    || fail "the demo without [megatron] does not say that it skips megatron"
"$PROBE" report "$WORK/base/moe"
"$PROBE" gate "$WORK/base/moe" --max k3_kl=10

set +e
MESSAGE="$("$PROBE" rescore "$WORK/base/moe" --engine megatron 2>&1)"
CODE=$?
set -e
echo "$MESSAGE"
[ "$CODE" -eq 2 ] || fail "rescore --engine megatron without [megatron] exited $CODE, expected 2"
grep -qF "pip install 'mismatch-probe[megatron]'" <<<"$MESSAGE" || fail "no install command in: $MESSAGE"
[ ! -e "$WORK/base/moe/scores/megatron-fp32" ] || fail "the refused rescore left scores/megatron-fp32 behind"

step "with [megatron]"
"$PY" -m pip install -q "$WHEEL[megatron]"
"$PROBE" "${DEMO[@]}" --out "$WORK/full" 2>&1 | tee "$WORK/full.log"
grep -q "skipping the megatron" "$WORK/full.log" && fail "the demo skipped megatron with [megatron] installed"
ls "$WORK/full/moe/scores" | grep -q megatron || fail "the full demo has no megatron score set"
step "ok"
