#!/usr/bin/env bash
# Create .venv with unicron and its development tools. CPU PyTorch 2.13.0 is pinned here so a
# fresh machine does not pull a multi-GB CUDA build; GPU users install their own torch first
# (the project itself only asks for torch>=2.3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev]"
echo "unicron installed in .venv ($(.venv/bin/unicron --version 2>/dev/null || echo ok))"
