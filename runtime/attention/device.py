"""Which GPU kernel backend the default device has: what the fused kernels
(paged_kernel.py) and the block gather (gather.py) each ask before they run."""

import mlx.core as mx


def available(dialect: str) -> bool:
    """Is the default device a GPU with this kernel's backend (`cuda` or `metal`)?"""
    backend = mx.cuda if dialect == "cuda" else mx.metal
    return backend.is_available() and mx.default_device() == mx.gpu
