#!/usr/bin/env bash
# Install shmbuffer and its test tools into ./.venv. torch is pinned first to the CPU build:
# a bare `torch` requirement would pull a multi-GB CUDA build. EXTRAS (default dev,examples,torchrl,live,fast) picks the extras; add bench for the peers.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
EXTRAS="${EXTRAS:-dev,examples,torchrl,live,fast}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[${EXTRAS}]"
# Compile the streaming copy of large rows and the uniform draws once (the fast extra; numba
# caches them beside the package): a first compile takes seconds, which the first writer,
# reader or long-sampling process would spend instead.
.venv/bin/python -c "from shmbuffer import spans, streamcopy; streamcopy.warm(); spans.load_compiled_draws()"
