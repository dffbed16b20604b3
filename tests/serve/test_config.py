"""A bad configuration fails before anything starts, with a message naming the field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvcached_testing.serve_controller import controller_env, write_config
from tests.serve.conftest import serve_importable

pytestmark = pytest.mark.skipif(not serve_importable(),
                                reason="kvcached-serve's dependencies are not installed here")


def _models(tmp: Path, **extra) -> list[dict]:
    (tmp / "m").mkdir(exist_ok=True)
    (tmp / "m" / "model.safetensors").write_bytes(b"\0" * 1000)
    return [{"name": "a", "engine": "vllm", "model": str(tmp / "m"), **extra}]


def _check(tmp: Path, cfg: dict) -> str:
    from kvcached_serve.config import ConfigError, parse_config

    with pytest.raises(ConfigError) as info:
        parse_config(cfg, "serve.yaml")
    return str(info.value)


def test_fields_are_named(tmp_path: Path):
    msg = _check(tmp_path, {"models": [{"name": "a", "engine": "tgi", "model": "x"}]})
    assert "models.0 (a).engine" in msg and "'vllm' or 'sglang'" in msg
    msg = _check(tmp_path, {"models": []})
    assert "models:" in msg
    msg = _check(tmp_path, {"device_budget": "lots", "models": _models(tmp_path)})
    assert "device_budget" in msg and "'lots' is not a size" in msg
    msg = _check(tmp_path, {"models": _models(tmp_path, kv_share=1.5)})
    assert "models.0 (a).kv_share" in msg
    msg = _check(tmp_path, {"models": _models(tmp_path, kv_share=0.5)})
    assert "kv_share needs a device_budget" in msg
    msg = _check(tmp_path, {"models": _models(tmp_path) + _models(tmp_path)})
    assert "the name a is used twice" in msg
    msg = _check(tmp_path, {"models": _models(tmp_path, args={"port": 9000})})
    assert "models.0 (a).args" in msg and "port" in msg and "set by the controller" in msg
    msg = _check(tmp_path, {"models": _models(tmp_path, idle={"sleep_after": 5})})
    assert "models.0 (a).idle.sleep_after" in msg and "Extra inputs" in msg
    msg = _check(tmp_path, {"devise": "cpu", "models": _models(tmp_path)})
    assert "devise" in msg
    msg = _check(tmp_path, {"device": "tpu:0", "models": _models(tmp_path)})
    assert "device" in msg and "cpu or cuda:N" in msg
    msg = _check(tmp_path, {"weight_capacity": "1G", "models": [
        {"name": "hub", "engine": "vllm", "model": "org/some-model"}]})
    assert "models.hub.weight_bytes" in msg and "weight_capacity" in msg
    msg = _check(tmp_path, {"weight_capacity": 100, "models": _models(tmp_path)})
    assert "never fit the weight_capacity" in msg


def test_good_config_resolves(tmp_path: Path):
    from kvcached_serve.config import parse_config

    cfg = parse_config({"device_budget": "1.5G", "weight_capacity": "10K",
                        "models": _models(tmp_path, args={"max_model_len": 2048,
                                                          "enforce_eager": True,
                                                          "enable_prefix_caching": False})})
    (m,) = cfg.models
    assert cfg.device_budget == 3 << 29 and m.weight_bytes == 1000 and m.device == "cpu"
    assert m.engine_flags() == ["--max-model-len", "2048", "--enforce-eager"]
    assert cfg.namespace_of(m) == "a"


def test_cli_refuses_a_bad_file_and_starts_nothing(tmp_path: Path):
    shm = tmp_path / "shm"
    path = write_config(tmp_path / "bad.yaml", {
        "shm_dir": str(shm), "log_dir": str(tmp_path / "logs"),
        "models": _models(tmp_path, engine="vllm", queue={"timeout_s": -1})})
    out = subprocess.run([sys.executable, "-m", "kvcached_serve", str(path)],
                         env=controller_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "models.0 (a).queue.timeout_s" in out.stderr and "greater than 0" in out.stderr
    assert not shm.exists() and not (tmp_path / "logs").exists()  # nothing was started
    (tmp_path / "notyaml.yaml").write_text("models: [a, {b")
    out = subprocess.run([sys.executable, "-m", "kvcached_serve", str(tmp_path / "notyaml.yaml")],
                         env=controller_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "not valid YAML" in out.stderr
    out = subprocess.run([sys.executable, "-m", "kvcached_serve", str(tmp_path / "none.yaml")],
                         env=controller_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "cannot read the configuration" in out.stderr


def test_check_prints_the_resolved_config(tmp_path: Path):
    import json

    path = write_config(tmp_path / "ok.yaml", {"models": _models(tmp_path)})
    out = subprocess.run([sys.executable, "-m", "kvcached_serve", "--check", str(path)],
                         env=controller_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    resolved = json.loads(out.stdout)
    assert resolved["models"][0]["device"] == "cpu" and resolved["queue"]["timeout_s"] == 120
    assert resolved["models"][0]["weight_bytes"] is None  # measured only with a weight_capacity


def test_engine_command_and_environment(tmp_path: Path):
    """What each engine is started with: kvcached on, its namespace, the budget, its share;
    on a GPU the engine's own sleep mode, on the CPU none (the process stops instead)."""
    from kvcached_serve.config import parse_config
    from kvcached_serve.engines import EngineProcess, sleep_mode_for

    cfg = parse_config({"device_budget": "64M", "namespace_prefix": "p-", "shm_dir": "/s",
                        "models": [
                            *_models(tmp_path, kv_share=0.25, args={"max_model_len": 2048},
                                     env={"EXTRA": "1"}),
                            {"name": "g", "engine": "vllm", "model": "org/m", "device": "cuda:1"},
                            {"name": "s", "engine": "sglang", "model": "org/s", "device": "cuda:0",
                             "python": "/envs/sg/bin/python"}]})
    a, g, s = (EngineProcess(cfg, m, tmp_path) for m in cfg.models)
    cmd, env = a.command(), a.environment()
    assert cmd[3:6] == ["serve", str(tmp_path / "m"), "--host"]
    assert cmd[cmd.index("--served-model-name") + 1] == "a" and "--enable-sleep-mode" not in cmd
    assert cmd[-2:] == ["--max-model-len", "2048"]
    assert env["KVCACHED_ENABLED"] == "1" and env["KVCACHED_IPC_NAME"] == "p-a"
    assert env["KVCACHED_DEVICE_BUDGET"] == str(64 << 20)
    assert env["KVCACHED_MEMORY_LIMIT"] == str(16 << 20) and env["KVCACHED_SHM_DIR"] == "/s"
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["EXTRA"] == "1"
    assert sleep_mode_for(cfg, cfg.models[0]) == "process"
    assert sleep_mode_for(cfg, cfg.models[1]) == "engine"
    assert "--enable-sleep-mode" in g.command()
    genv = g.environment()
    assert genv["CUDA_VISIBLE_DEVICES"] == "1" and genv["VLLM_SERVER_DEV_MODE"] == "1"
    scmd = s.command()
    assert scmd[:3] == ["/envs/sg/bin/python", "-m", "sglang.launch_server"]
    assert "--enable-memory-saver" in scmd and scmd[scmd.index("--model-path") + 1] == "org/s"


def test_vllm_engines_on_the_cpu_get_cores_of_their_own(tmp_path: Path, monkeypatch):
    """vLLM binds every CPU engine to the same first cores: the controller splits them."""
    from kvcached_serve.config import parse_config
    from kvcached_serve.engines import CPU_BIND_VAR, cpu_binding

    monkeypatch.delenv(CPU_BIND_VAR, raising=False)
    m = str(_models(tmp_path)[0]["model"])
    models = [{"name": n, "engine": "vllm", "model": m} for n in ("a", "b", "c")]
    cfg = parse_config({"models": [*models, {"name": "s", "engine": "sglang", "model": m},
                                   {"name": "t", "engine": "vllm", "model": m,
                                    "args": {"tensor_parallel_size": 2}}]})
    binds = [cpu_binding(cfg, x, cpus=list(range(8))) for x in cfg.models]
    assert binds[:3] == [{CPU_BIND_VAR: "0,1"}, {CPU_BIND_VAR: "2,3"}, {CPU_BIND_VAR: "4,5"}]
    assert binds[3:] == [{}, {}]  # SGLang, and a parallel engine: their own defaults
    few = [cpu_binding(cfg, x, cpus=[0, 1]) for x in cfg.models[:3]]
    assert few == [{CPU_BIND_VAR: "nobind", "OMP_NUM_THREADS": "1"}] * 3
    alone = parse_config({"models": [models[0]]})
    assert cpu_binding(alone, alone.models[0], cpus=list(range(8))) == {}
    own = parse_config({"models": [{**models[0], "env": {CPU_BIND_VAR: "7"}}, models[1]]})
    assert cpu_binding(own, own.models[1], cpus=list(range(8))) == {}  # one left: vLLM's own
    from kvcached_serve.engines import EngineProcess

    env = EngineProcess(own, own.models[0], tmp_path).environment()
    assert env[CPU_BIND_VAR] == "7"  # the config's own binding wins
    monkeypatch.setenv(CPU_BIND_VAR, "nobind")  # so does the controller's environment
    assert cpu_binding(cfg, cfg.models[0], cpus=list(range(8))) == {}
