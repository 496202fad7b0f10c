"""Verification kernels: Triton on CUDA, with the plain-PyTorch reference as the CPU path.

This package deliberately defines no ``__version__``: transformers probes for an unrelated
Hugging Face package that is also imported as ``kernels``, and a version in its supported
range would make transformers try to load hub kernels from here (see tests/test_packaging.py).
"""

from kernels.rejection import greedy_verify, rejection_sample

__all__ = ["greedy_verify", "rejection_sample"]
