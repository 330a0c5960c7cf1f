"""Triton kernels of the Triton attention backend (imported only when that backend is chosen)."""
