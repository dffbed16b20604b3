"""What the tests (``tests/``) and the benchmarks (``benchmarks/``) both run.

Neither imports from the other; both import from here. Importable with the
repository root on ``sys.path`` (pytest puts it there; the benchmark scripts
insert it). No distribution ships this package: the wheels take only
``kvcached_core``, ``kvcached_vllm`` and ``kvcached_sglang``.

``tiny_model``
    a tiny random-weight Llama and its tokenizer, built locally (no downloads).
``vllm_cpu``
    the tiny vLLM engine on CPU: its geometry, token-id prompts, a KV cache config
    shaped like its own, and vLLM's block pool beside kvcached's elastic one.
``vllm_serve``
    ``vllm serve`` in a subprocess, and a vanilla control that tells a host where the
    engine itself cannot serve from a kvcached failure.
``shared_budget``
    two engines sharing one device budget: giveback and live limits
    (``tests/vllm/test_shared_budget.py``, ``benchmarks/bench_vllm_share.py``).
``sglang_release``
    the environment of a subprocess that runs an SGLang release from ``.sglang/``
    (with the import shims of ``sglang_shims/``).
``tp_worker``
    a tensor-parallel worker process: elastic K/V tensors served over IPC.
"""
