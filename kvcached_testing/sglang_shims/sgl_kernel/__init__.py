"""Test shim for ``sgl_kernel`` (SGLang's CUDA kernel package).

Why: PyPI's sgl-kernel is a CUDA build (it fails to load here: libnvrtc missing). SGLang's
memory-pool modules import ``sgl_kernel.kvcacheio`` at module level; the CPU tests never call
these kernels. Anything used raises NotImplementedError.
"""

from _cuda_only import missing_attrs

__getattr__ = missing_attrs("sgl_kernel", "a CUDA kernel, stubbed in the SGLang CPU tests")
