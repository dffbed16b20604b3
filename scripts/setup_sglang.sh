#!/usr/bin/env bash
# Installs the SGLang releases the kvcached-sglang adapter is tested against, each in its
# own target directory, without touching the main virtual environment:
#   .sglang/<version>/   sglang==<version> (--no-deps) plus the few version-pinned packages
#                        its memory-pool and scheduler modules import (transformers, openai, ...)
#   .sglang/_common/     the light packages every release imports (pydantic, aiohttp, zmq, ...)
#   .sglang/_http/       what importing the HTTP server (sglang.srt.entrypoints.http_server)
#                        needs beyond that (jsonschema, python-multipart, soundfile, ...):
#                        tests/sglang/test_metrics.py builds SGLang's /metrics route from it
#   .sglang/wheels/      the wheel cache (pip download): CI caches this folder
# Nothing here pulls sgl-kernel, flashinfer or a CUDA torch: the tests run on the main venv's
# CPU torch, with the shims in kvcached_testing/sglang_shims for the modules that cannot exist
# on CPU. Tests find the directories through kvcached_testing/sglang_release.py and skip
# releases not installed.
#
# Usage: scripts/setup_sglang.sh [VERSION ...]     (default: every tested release)
#        PYTHON=.venv/bin/python scripts/setup_sglang.sh 0.5.12.post1
#        SGLANG_OFFLINE=1 ...  installs from .sglang/wheels only (no index)
# Safe to run again: a directory whose sglang already reports the wanted version is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
ROOT=.sglang
WHEELS=$ROOT/wheels
mkdir -p "$WHEELS"

# Per release: the pins its modules need beside _common (transformers with a matching
# huggingface-hub/tokenizers; openai where the protocol types are imported).
declare -A EXTRA=(
  [0.4.9.post6]="transformers==4.54.0 huggingface-hub==0.34.4 tokenizers==0.21.4 openai==1.99.1"
  [0.4.10.post2]="transformers==4.54.1 huggingface-hub==0.34.4 tokenizers==0.21.4 openai==1.99.1"
  [0.5.1]="transformers==4.55.2 huggingface-hub==0.34.4 tokenizers==0.21.4 openai==1.99.1 openai-harmony==0.0.4"
  [0.5.3]="transformers==4.57.0 huggingface-hub==0.36.0 tokenizers==0.22.1 openai==1.99.1 openai-harmony==0.0.4 xgrammar==0.1.24"
  [0.5.4]="transformers==4.57.1 huggingface-hub==0.36.0 tokenizers==0.22.1 openai==1.99.1 openai-harmony==0.0.4 xgrammar==0.1.25"
  [0.5.9]="transformers==4.57.1 huggingface-hub==0.36.0 tokenizers==0.22.1 openai==2.6.1 openai-harmony==0.0.4 apache-tvm-ffi==0.1.9 xgrammar==0.1.27"
  [0.5.11]="transformers==5.6.0 huggingface-hub==1.33.0 tokenizers==0.22.2 openai==2.6.1 openai-harmony==0.0.4 apache-tvm-ffi==0.1.9"
  [0.5.12.post1]="transformers==5.6.0 huggingface-hub==1.33.0 tokenizers==0.22.2 openai==2.6.1 openai-harmony==0.0.4 apache-tvm-ffi==0.1.9"
  [0.5.13]="transformers==5.8.1 huggingface-hub==1.33.0 tokenizers==0.22.2 openai==2.6.1 openai-harmony==0.0.4 apache-tvm-ffi==0.1.9"
  [0.5.15]="transformers==5.12.1 huggingface-hub==1.33.0 tokenizers==0.22.2 openai==2.6.1 openai-harmony==0.0.4 apache-tvm-ffi==0.1.11"
  [0.5.23]="transformers==5.19.0 huggingface-hub==1.33.0 tokenizers==0.23.2 openai==2.8.0 openai-harmony==0.0.4 apache-tvm-ffi==0.1.11 xgrammar==0.2.7"
)
COMMON="tqdm pybase64 requests urllib3 idna certifi charset-normalizer ipython traitlets decorator
  jedi parso matplotlib-inline prompt_toolkit wcwidth pexpect ptyprocess stack_data asttokens
  executing pure_eval pydantic pydantic-core typing-inspection annotated-types aiohttp multidict
  attrs yarl propcache aiohappyeyeballs aiosignal frozenlist triton psutil pyzmq fastapi starlette
  anyio annotated-doc opentelemetry-api importlib-metadata zipp pillow orjson sniffio distro
  partial-json-parser dill sentencepiece einops loguru gguf uvloop msgspec uvicorn h11 click
  setproctitle PyYAML regex safetensors typer shellingham rich markdown-it-py mdurl hf-xet httpx
  httpcore jiter interegular cloudpickle compressed-tensors==0.12.2 pyzmq setuptools-scm numpy"
# Only the HTTP server's module imports these (tests/sglang/test_metrics.py).
HTTP="jsonschema jsonschema-specifications referencing rpds-py python-multipart soundfile cffi
  pycparser"

pip() { "$PY" -m pip --disable-pip-version-check -q "$@"; }
fetch() {  # fetch SPEC... : into the wheel cache (no-op offline)
  [ "${SGLANG_OFFLINE:-0}" = 1 ] || pip download --no-deps -d "$WHEELS" "$@"
}
install_into() {  # install_into DIR SPEC... : --no-deps from the cache
  local dir=$1; shift
  pip install --no-deps --no-index --find-links "$WHEELS" --target "$dir" --upgrade "$@"
}

if [ ! -f "$ROOT/_common/.done" ]; then
  # shellcheck disable=SC2086
  fetch $COMMON
  rm -rf "$ROOT/_common"
  # shellcheck disable=SC2086
  install_into "$ROOT/_common" $COMMON
  touch "$ROOT/_common/.done"
fi
if [ ! -f "$ROOT/_http/.done" ]; then
  fetch $HTTP
  rm -rf "$ROOT/_http"
  install_into "$ROOT/_http" $HTTP
  touch "$ROOT/_http/.done"
fi

versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=("${!EXTRA[@]}")
for v in "${versions[@]}"; do
  extra=${EXTRA[$v]:-}
  [ -n "$extra" ] || echo "setup_sglang: no pins known for $v; installing sglang only" >&2
  if [ -f "$ROOT/$v/.done" ]; then echo "setup_sglang: $ROOT/$v ready"; continue; fi
  # shellcheck disable=SC2086
  fetch "sglang==$v" $extra
  rm -rf "${ROOT:?}/$v"
  # shellcheck disable=SC2086
  install_into "$ROOT/$v" "sglang==$v" $extra
  touch "$ROOT/$v/.done"
  echo "setup_sglang: $ROOT/$v ready"
done
