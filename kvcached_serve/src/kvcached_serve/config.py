"""The controller's configuration: a YAML file checked by pydantic before anything starts.

A bad file is a :class:`ConfigError` whose message names every bad field by its path
(``models.1.engine: Input should be 'vllm' or 'sglang'``); nothing is launched.

Example::

    device: cpu
    device_budget: 256M          # KV bytes all engines may map together (kvcached's budget)
    weight_capacity: 1G          # weight bytes the awake models may hold together
    queue: {max_size: 64, timeout_s: 120}
    models:
      - name: llama-a
        engine: vllm
        model: /models/llama-a
        args: {max_model_len: 2048, enforce_eager: true}
        kv_share: 0.5            # at most half of the budget for this model's KV cache
        idle: {sleep_after_s: 300}
      - name: qwen-b
        engine: sglang
        model: /models/qwen-b
        start: lazy              # first started by its first request
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = [
    "ConfigError",
    "IdlePolicy",
    "ModelConfig",
    "QueuePolicy",
    "RestartPolicy",
    "ServeConfig",
    "load_config",
    "parse_config",
]

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,47}$")
_SIZE_RE = re.compile(r"^\s*(\d+)(?:\.(\d+))?\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
#: Engine flags the controller sets itself (address, name, model path).
RESERVED_ARGS = {"host", "port", "served_model_name", "model", "model_path", "served-model-name",
                 "model-path"}
#: Files whose sizes make a local model's weight bytes.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the field(s)."""


def parse_size(value: Any) -> int:
    """A byte count: an int, or text such as ``512M``, ``2G``, ``1.5GiB``."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size (use e.g. 512M, 2G, 1048576)")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{value} is negative; a size is a byte count >= 0")
        return value
    m = _SIZE_RE.match(str(value))
    if m is None:
        raise ValueError(f"{value!r} is not a size (use e.g. 512M, 2G, 1048576)")
    whole, frac, unit = m.group(1), m.group(2) or "", m.group(3).lower()
    scale = _UNITS[unit]
    return int(whole) * scale + (int(frac) * scale // 10 ** len(frac) if frac else 0)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class IdlePolicy(_Strict):
    """When an idle model sleeps."""

    sleep_after_s: float | None = Field(
        default=None, gt=0, description="sleep after this many seconds without a request "
        "(none: only when another model needs its weight memory)")


class QueuePolicy(_Strict):
    """Requests waiting for a model that is starting or waking."""

    max_size: int = Field(default=64, ge=0, description="waiting requests per model; "
                          "beyond it a request gets 503 at once")
    timeout_s: float = Field(default=120.0, gt=0, description="a request waits this long "
                             "for its model, then gets 503 with Retry-After")


class RestartPolicy(_Strict):
    """Restarting an engine that exited by itself."""

    backoff_s: float = Field(default=1.0, ge=0, description="first delay before a restart")
    max_backoff_s: float = Field(default=60.0, ge=0, description="the delay doubles up to this")
    reset_after_s: float = Field(default=120.0, gt=0, description="an engine up this long "
                                 "restarts with the first delay again")


class ModelConfig(_Strict):
    """One model served by one engine process."""

    name: str = Field(description="the name requests use in their 'model' field")
    engine: Literal["vllm", "sglang"]
    model: str = Field(description="model path (or hub id) given to the engine")
    args: dict[str, Any] | list[str] = Field(
        default_factory=dict, description="engine flags: {max_model_len: 2048} becomes "
        "--max-model-len 2048 (true: the bare flag; false: left out), or a list of arguments")
    device: str | None = Field(default=None, description="cpu or cuda:N (default: the "
                               "top-level device)")
    kv_share: float | None = Field(default=None, gt=0, le=1, description="cap on this "
                                   "model's KV bytes as a share of device_budget")
    weight_bytes: int | None = Field(default=None, description="weight memory of the model "
                                     "awake (default: the size of its weight files)")
    idle: IdlePolicy = Field(default_factory=IdlePolicy)
    queue: QueuePolicy | None = Field(default=None, description="overrides the top-level queue")
    start: Literal["eager", "lazy"] = Field(default="eager", description="eager: started "
                                            "with the controller; lazy: by its first request")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment of the "
                                "engine process")
    python: str | None = Field(default=None, description="interpreter that runs the engine "
                               "(default: the controller's)")
    namespace: str | None = Field(default=None, description="kvcached IPC namespace "
                                  "(default: namespace_prefix + name)")
    port: int | None = Field(default=None, ge=1, le=65535, description="the engine's port "
                             "(default: a free one)")
    startup_timeout_s: float = Field(default=600.0, gt=0)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME_RE.match(v):
            raise ValueError(f"{v!r} is not a model name: letters, digits, '_', '.', '-', "
                             "at most 48, starting with a letter or digit")
        return v

    @field_validator("namespace")
    @classmethod
    def _ns(cls, v: str | None) -> str | None:
        if v is not None and not _NAME_RE.match(v):
            raise ValueError(f"{v!r} is not a kvcached namespace: letters, digits, '_', '.', "
                             "'-', at most 48")
        return v

    @field_validator("weight_bytes", mode="before")
    @classmethod
    def _size(cls, v: Any) -> Any:
        return None if v is None else parse_size(v)

    @field_validator("device")
    @classmethod
    def _device(cls, v: str | None) -> str | None:
        return None if v is None else _check_device(v)

    @field_validator("args")
    @classmethod
    def _args(cls, v: dict[str, Any] | list[str]) -> dict[str, Any] | list[str]:
        keys = (v.keys() if isinstance(v, dict)
                else [a[2:].split("=", 1)[0] for a in v if a.startswith("--")])
        bad = sorted(k for k in keys if k in RESERVED_ARGS or k.replace("-", "_") in RESERVED_ARGS)
        if bad:
            raise ValueError(f"{', '.join(bad)}: set by the controller (the model's name, "
                             "path and port come from name, model and port)")
        return v

    def engine_flags(self) -> list[str]:
        """:attr:`args` as command-line arguments."""
        if isinstance(self.args, list):
            return list(self.args)
        out: list[str] = []
        for key, value in self.args.items():
            flag = "--" + key.replace("_", "-")
            if value is True:
                out.append(flag)
            elif value is False or value is None:
                continue
            elif isinstance(value, (list, tuple)):
                out += [flag, *map(str, value)]
            elif isinstance(value, dict):
                import json

                out += [flag, json.dumps(value)]
            else:
                out += [flag, str(value)]
        return out


def _check_device(v: str) -> str:
    if v == "cpu" or re.fullmatch(r"cuda:\d+", v):
        return v
    if v == "cuda":
        return "cuda:0"
    raise ValueError(f"{v!r} is not a device: cpu or cuda:N")


class ServeConfig(_Strict):
    """The whole file."""

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    device: str = Field(default="cpu", description="default device of the models")
    device_budget: int | None = Field(default=None, description="KV bytes all engines of "
                                      "a device may map together (none: no budget)")
    kv_balance: bool = Field(default=True, description="while several models of a device "
                             "have requests, limit each one's KV to a share of device_budget "
                             "in proportion to its requests (in flight and queued)")
    kv_min_share: float = Field(default=0.1, gt=0, le=1, description="the smallest share "
                                "kv_balance gives a model (also an idle one)")
    weight_capacity: int | None = Field(default=None, description="weight bytes the awake "
                                        "models of a device may hold together (none: no cap)")
    sleep_mode: Literal["auto", "engine", "process"] = Field(
        default="auto", description="engine: the engine's own sleep mode (GPU); process: "
        "stop and restart the process; auto: engine on GPUs, process on the CPU")
    namespace_prefix: str = Field(default="", description="prepended to each model's "
                                  "kvcached namespace")
    shm_dir: str | None = Field(default=None, description="kvcached's shared-memory "
                                "directory (KVCACHED_SHM_DIR; default /dev/shm)")
    ipc_dir: str | None = Field(default=None, description="kvcached's socket directory "
                                "(KVCACHED_IPC_DIR; default $XDG_RUNTIME_DIR/kvcached or "
                                "/tmp/kvcached-<uid>)")
    queue: QueuePolicy = Field(default_factory=QueuePolicy)
    restart: RestartPolicy = Field(default_factory=RestartPolicy)
    log_dir: str | None = Field(default=None, description="engine logs (default: a "
                                "temporary directory)")
    models: list[ModelConfig] = Field(min_length=1)

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        return _check_device(v)

    @field_validator("device_budget", "weight_capacity", mode="before")
    @classmethod
    def _size(cls, v: Any) -> Any:
        return None if v is None else parse_size(v)

    @field_validator("namespace_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if v and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,15}", v):
            raise ValueError(f"{v!r}: letters, digits, '_', '.', '-', at most 16")
        return v

    @model_validator(mode="after")
    def _whole(self) -> ServeConfig:
        names = [m.name for m in self.models]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"models: the name {', '.join(dup)} is used twice")
        for m in self.models:
            if m.device is None:
                m.device = self.device
            if m.kv_share is not None and self.device_budget is None:
                raise ValueError(f"models.{m.name}.kv_share needs a device_budget to be a share of")
        spaces = [self.namespace_of(m) for m in self.models]
        dup = sorted({n for n in spaces if spaces.count(n) > 1})
        if dup:
            raise ValueError(f"models: the kvcached namespace {', '.join(dup)} is used twice")
        ports = [m.port for m in self.models if m.port is not None]
        dup = sorted({p for p in ports if ports.count(p) > 1 or p == self.port})
        if dup:
            raise ValueError(f"models.port: {', '.join(map(str, dup))} is used twice")
        if self.weight_capacity is not None:
            for m in self.models:
                if m.weight_bytes is None:
                    found = local_weight_bytes(m.model)
                    if found is None:
                        raise ValueError(
                            f"models.{m.name}.weight_bytes: needed with a weight_capacity, and "
                            f"{m.model!r} is no local directory of weight files to measure")
                    m.weight_bytes = found
                if m.weight_bytes > self.weight_capacity:
                    raise ValueError(
                        f"models.{m.name}.weight_bytes: {m.weight_bytes} bytes never fit the "
                        f"weight_capacity of {self.weight_capacity}")
        return self

    def namespace_of(self, m: ModelConfig) -> str:
        """The kvcached namespace of a model's engine: what kvctl and kvtop show."""
        return m.namespace or f"{self.namespace_prefix}{m.name}"

    def queue_of(self, m: ModelConfig) -> QueuePolicy:
        return m.queue or self.queue


def local_weight_bytes(model: str) -> int | None:
    """The size of a local model directory's weight files, or None (no such directory)."""
    path = Path(model)
    if not path.is_dir():
        return None
    files = [p for p in path.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)]
    return sum(p.stat().st_size for p in files) if files else None


def _where(loc: tuple[Any, ...], data: Any) -> str:
    """A field path, with model indices shown as their names where known."""
    parts: list[str] = []
    node = data
    for key in loc:
        label = str(key)
        if isinstance(key, int) and isinstance(node, list) and key < len(node):
            item = node[key]
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                label = f"{key} ({item['name']})"
            node = item
        elif isinstance(node, dict):
            node = node.get(key)
        else:
            node = None
        parts.append(label)
    return ".".join(parts)


def parse_config(data: Any, source: str = "config") -> ServeConfig:
    """Check a configuration already read into Python data.

    Raises:
        ConfigError: naming each bad field.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top (models:, device_budget:, "
                          f"...), got {type(data).__name__}")
    try:
        return ServeConfig.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            where = _where(tuple(err["loc"]), data) or "(top level)"
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"  {where}: {msg}")
        raise ConfigError(f"{source}: {len(lines)} error(s)\n" + "\n".join(lines)) from None


def load_config(path: str | os.PathLike[str]) -> ServeConfig:
    """Read and check a YAML configuration file.

    Raises:
        ConfigError: The file is missing, not YAML, or a field is wrong (named).
    """
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the configuration ({exc.strerror or exc})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return parse_config(data, str(path))
