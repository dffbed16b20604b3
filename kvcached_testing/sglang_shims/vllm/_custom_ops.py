"""Test shim for ``vllm._custom_ops`` (FP8 kernels SGLang 0.4.x imports; never called on CPU)."""

from _cuda_only import missing_attrs

__getattr__ = missing_attrs("vllm._custom_ops", "stubbed in the SGLang CPU tests")
