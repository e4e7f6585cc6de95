#!/usr/bin/env bash
# Install shmbuffer and its test tools into ./.venv. torch is pinned first to the CPU build:
# a bare `torch` requirement would pull a multi-GB CUDA build. EXTRAS (default dev,examples,torchrl,live,fast,compress,offline) picks the extras; add bench for the peers.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
EXTRAS="${EXTRAS:-dev,examples,torchrl,live,fast,compress,offline}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[${EXTRAS}]"
# TorchRL's compiled part (the segment trees of its prioritized buffers) comes built against
# torch 2.14, whose CPU build PyPI does not carry: compile it from the sources its wheel ships
# against the torch pinned above (about a minute; a no-op without torchrl, or when it loads).
.venv/bin/python scripts/torchrl_ext.py
# Compile the streaming copy of large rows and the uniform draws once (the fast extra; numba
# caches them beside the package): a first compile takes seconds, which the first writer,
# reader or long-sampling process would spend instead.
.venv/bin/python -c "from shmbuffer.registry import spans; from shmbuffer.storage import streamcopy; streamcopy.warm(); spans.load_compiled_draws()"
