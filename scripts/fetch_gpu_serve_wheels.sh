#!/usr/bin/env bash
# fetch_gpu_serve_wheels.sh -- download the few wheels that `vllm serve` (vLLM 0.26.0's Python
# OpenAI-compatible server) and `kvcached-serve` need on the offline GPU machine, beyond what that
# machine already has (shared/gpu-vllm/host-packages.txt) and what the offline vLLM bundle carries
# (shared/gpu-vllm/vllm-0.26.0-sm90-site.tar.xz, pins in shared/gpu-vllm/deps-0.26.0.lock).
#
# Usage (on a machine with network, from anywhere in the checkout):
#   scripts/fetch_gpu_serve_wheels.sh            # -> .gpu-vllm/serve-wheels/*.whl (git-ignored, carried)
#   DEST=/some/dir PYV=3.12 scripts/fetch_gpu_serve_wheels.sh
# On the GPU machine (no network), after unpacking the bundle to /tmp/site:
#   python3 -m pip install --no-deps --no-index --target /tmp/site .gpu-vllm/serve-wheels/*.whl
#   export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
#   python3 -m vllm.entrypoints.cli.main serve MODEL ...   # the bundle has no bin/vllm launcher
#
# Why: build_bundle.sh leaves out everything matching its DENY regex (server/CLI-only packages that
# `vllm.LLM` never imports).  Following vLLM 0.26.0's imports from vllm/entrypoints/cli/main.py,
# cli/serve.py and openai/api_server.py (module level, plus the routers build_app() imports) through
# the bundle's own packages, the third-party modules found neither on the host nor in the bundle are:
#   uvicorn   imported at module level by vllm/entrypoints/launcher.py and openai/dp_supervisor.py
#             (which cli/serve.py imports); also kvcached_serve/cli.py.
#   jmespath  imported at module level by model_hosting_container_standards.sagemaker (bundled), which
#             vllm/entrypoints/serve/sagemaker/api_router.py imports; build_app() always registers
#             that router, so `vllm serve` fails at startup without it.
# plus what uvicorn[standard] (vllm requires fastapi[standard]) uses when present:
#   httptools (http="auto" -> fast HTTP parser), websockets (WebSocket routes, e.g. /v1/realtime),
#   python-dotenv (only for --env-file; tiny).  uvloop and PyYAML are on the host, watchfiles is
#   in the bundle, click/h11 (uvicorn's own deps) are on the host.
# and truststore: httpcore2 (the bundled openai client's transport) imports it as soon as an
#   openai.OpenAI() client is built (vllm's `chat`/`complete` CLI, MCP tool servers); pure python, 20 kB.
# kvcached-serve needs starlette, pydantic (bundle), httpx, PyYAML, prometheus-client (host), uvicorn.
# Deliberately NOT fetched (only used by opt-in features): mcp, mcp-types, sse-starlette,
#   pydantic-settings, pyjwt, cryptography, cffi (--tool-server MCP); anthropic (vllm 0.26's
#   /v1/messages route does not import it); opentelemetry-exporter-*, opentelemetry-proto,
#   googleapis-common-protos (--otlp-traces-endpoint); fastapi-cli & co.; supervisor (never
#   imported; sagemaker's supervisord launcher only); dill (depyf debugging); nvidia-* (host has cu13).
# Versions: those pip resolves for `vllm==0.26.0` next to the bundle's lock (uvicorn 0.55.0 satisfies
# fastapi[standard]'s uvicorn[standard]>=0.12; same set as a regular vllm install).
set -euo pipefail
ROOT=$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)
DEST=${DEST:-$ROOT/.gpu-vllm/serve-wheels}
PYV=${PYV:-3.12}
PYTAG=cp${PYV/./}
MAX_MB=${MAX_MB:-20}
exec 2> >(grep --line-buffered -v "is ignored: it is neither a file nor a directory" >&2)   # local-index noise
PINS=(
  uvicorn==0.55.0           # the ASGI server (vllm serve, kvcached-serve)
  jmespath==1.1.0           # model_hosting_container_standards.sagemaker import (vllm serve startup)
  httptools==0.9.0          # uvicorn[standard]: C HTTP parser
  websockets==17.4          # uvicorn[standard]: WebSocket protocol
  python-dotenv==1.2.4      # uvicorn[standard]: --env-file
  truststore==0.10.5        # httpcore2 imports it when an openai.OpenAI() client is built
)
PLAT=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for n in 5 12 17 24 26 27 28; do PLAT+=(--platform manylinux_2_${n}_x86_64); done

mkdir -p "$(dirname "$DEST")"
TMP=$(mktemp -d "${DEST%/}.tmp.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
  --abi "$PYTAG" --abi abi3 --abi none "${PLAT[@]}" -d "$TMP" "${PINS[@]}"

# exactly one wheel per pin, cp312/abi3/py3 and manylinux x86_64 or pure python
for p in "${PINS[@]}"; do
  n=${p%%==*}; v=${p#*==}; f=${n//-/_}
  ls "$TMP"/ | grep -i -E "^${f}-${v//./\\.}-.*\.whl$" | grep -q . || { echo "missing wheel for $p" >&2; exit 1; }
done
for w in "$TMP"/*.whl; do
  case $(basename "$w") in
    *-none-any.whl|*-"$PYTAG"-*manylinux*x86_64*.whl|*-abi3-*manylinux*x86_64*.whl) ;;
    *) echo "unexpected wheel tag: $(basename "$w")" >&2; exit 1 ;;
  esac
done
total=$(du -cb "$TMP"/*.whl | tail -1 | cut -f1)
if [ "$total" -gt $((MAX_MB * 1000000)) ]; then
  echo "serve wheels total $total bytes > ${MAX_MB} MB" >&2; exit 1
fi

rm -rf "$DEST"; mv "$TMP" "$DEST"; trap - EXIT
chmod 755 "$DEST"
ls -l "$DEST" | awk 'NR>1 {printf "  %8d  %s\n", $5, $9}'
echo "$(ls "$DEST"/*.whl | wc -l) wheels, $total bytes in $DEST"
