"""KV-cache arithmetic from the design.

Bytes per token = 2 x layers x KV heads x head dim x bytes per value.
"""

from __future__ import annotations


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, bytes_per_value: int) -> int:
    """Keys and values (the 2), for every layer and KV head, at the stored precision."""
    return 2 * layers * kv_heads * head_dim * bytes_per_value


def kv_tokens_in_memory(kv_budget_bytes: float, bytes_per_token: int) -> int:
    """How many tokens of context fit in the KV budget at once."""
    return int(kv_budget_bytes // bytes_per_token)
