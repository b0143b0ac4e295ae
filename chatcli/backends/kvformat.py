"""The local engine's pinned KV format, part of every state file's identity.

Importable without llama_cpp, so commands that only look at files (``chatcli personas``: is this
persona's prefix cached?) can compute a state identity without loading libllama.
"""

from __future__ import annotations

from typing import Any

# Pinned context parameters that shape the saved KV format (part of every state file's identity).
KV_PARAMS: dict[str, object] = {"type_k": "f16", "type_v": "f16", "flash_attn": False, "kv_unified": True}


# The KV cache types chatcli offers (K and V alike); the engine maps them to ggml types.
KV_TYPE_NAMES: tuple[str, ...] = ("f16", "q8_0", "q4_0")


def kv_params_for(kv_type: str) -> dict[str, object]:
    """The identity-shaping context parameters of a KV type.

    llama.cpp refuses a quantized V cache without flash attention (llama_init_from_model: "quantized V
    cache requires flash_attn to be enabled"), so q8_0/q4_0 turn it on. Flash attention also stores V
    untransposed (the state's ``v_trans`` flag), a different saved layout: it is part of the identity. f16
    keeps it off: measured (bench/results/kv_layout.md), it evaluates prompts 1.13-1.26x faster but decodes
    0.92x near the end of a 4,096 context, and decoding is most of a chatcli turn.
    """
    if kv_type not in KV_TYPE_NAMES:
        raise ValueError(f"unknown KV type {kv_type!r}: use {', '.join(KV_TYPE_NAMES)}")
    return {**KV_PARAMS, "type_k": kv_type, "type_v": kv_type, "flash_attn": kv_type != "f16"}


def engine_identity(n_ctx: int, kv_params: dict[str, object] | None = None) -> dict[str, Any]:
    """What ``Engine.identity()`` returns for a context of ``n_ctx`` tokens."""
    return {"n_ctx": n_ctx, **(KV_PARAMS if kv_params is None else kv_params)}
