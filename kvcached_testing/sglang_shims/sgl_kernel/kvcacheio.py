"""Test shim for ``sgl_kernel.kvcacheio`` (CUDA KV-transfer kernels; see the package docstring)."""

from _cuda_only import missing_attrs

__getattr__ = missing_attrs("sgl_kernel.kvcacheio", "a CUDA kernel, stubbed in the CPU tests")
