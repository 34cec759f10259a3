#!/usr/bin/env bash
# Regenerates constraints.txt: the exact version of every package that `scripts/install.sh
# --test` installs (runtime, test and bench extras; the CPU build of torch), resolved by uv from
# pyproject.toml for CPython 3.11 on x86_64 Linux. scripts/install.sh installs with it, so a fresh
# machine gets the versions the suite was last run with; pyproject.toml keeps its ranges, so
# pagefleet still installs beside other packages. After refreshing, run the suite, then commit.
#
#     bash scripts/lock.sh            # newest versions pyproject.toml allows
#     bash scripts/lock.sh --upgrade-package transformers   # extra flags go to uv pip compile
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH="2.13.0+cpu"  # the CPU build; a GPU machine installs its own torch before install.sh

"$PY" -m uv --version >/dev/null 2>&1 || "$PY" -m pip install -q "uv>=0.5"

# The CPU build of torch comes from a wheel folder that pip is configured with, if one has it,
# else from PyTorch's CPU index.
sources=()
for dir in ${PIP_FIND_LINKS:-} $("$PY" -m pip config get global.find-links 2>/dev/null || true); do
    if compgen -G "$dir/torch-${TORCH}-*.whl" >/dev/null; then sources+=(--find-links "$dir"); fi
done
if (( ${#sources[@]} == 0 )); then
    sources=(--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match)
fi

"$PY" -m uv pip compile pyproject.toml --extra test --extra bench \
    --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
    "${sources[@]}" --constraint <(echo "torch==${TORCH}") \
    --no-emit-find-links --no-emit-index-url \
    --custom-compile-command "bash scripts/lock.sh" --quiet -o constraints.txt "$@"
