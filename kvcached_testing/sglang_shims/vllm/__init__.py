"""Test shim: SGLang 0.4.x imports ``vllm._custom_ops`` for FP8 on non-CUDA hosts (see README.md).

Only for the SGLang CPU tests; vLLM itself is not installed in their environment.
"""
