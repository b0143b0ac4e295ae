"""The local engine's pinned KV format, part of every state file's identity.

Importable without llama_cpp, so commands that only look at files (``chatcli personas``: is this
persona's prefix cached?) can compute a state identity without loading libllama.
"""

from __future__ import annotations

from typing import Any

# Pinned context parameters that shape the saved KV format (part of every state file's identity).
KV_PARAMS: dict[str, object] = {"type_k": "f16", "type_v": "f16", "flash_attn": False, "kv_unified": True}


def engine_identity(n_ctx: int, kv_params: dict[str, object] | None = None) -> dict[str, Any]:
    """What ``Engine.identity()`` returns for a context of ``n_ctx`` tokens."""
    return {"n_ctx": n_ctx, **(KV_PARAMS if kv_params is None else kv_params)}
