"""Paged KV cache: block bookkeeping (pool, prefix cache, manager) and the MLX storage."""
