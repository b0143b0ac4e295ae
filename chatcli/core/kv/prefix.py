"""The shared persona prefix cache: a persona's system prompt is evaluated once per model.

A prefix file is an ordinary state file (header + one CELLS record) in the cache dir, keyed by everything
its cells depend on: the model identity, the context parameters, the persona text and the chat template.
Editing the persona changes its hash, hence the key: stale entries are simply never read again.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Generator, Sequence

from chatcli.core.backend import Backend
from chatcli.core.events import Event, Notice
from chatcli.core.files.fsutil import ensure_private_dir, remove_stale_temp_files
from chatcli.core.steps import evaluate
from chatcli.core.template import ChatTemplate, Message


def state_identity(model_identity: dict[str, Any], backend_identity: dict[str, Any]) -> dict[str, Any]:
    """What saved cells must match to be loaded into a context: the model, and the backend's context
    parameters (``Backend.identity()``: context size and KV format)."""
    return {"model": model_identity, **backend_identity}


def persona_prefix_tokens(backend: Backend, template: ChatTemplate, messages: Sequence[Message]) -> list[int]:
    """The tokens of a persona's prefix: the one place they are made (creation, cache key and warm, open).

    A template that writes ``{{ bos_token }}`` itself (Llama 3, Mistral, Gemma) already starts with BOS:
    asking the tokenizer to add one too would give two, and a prefix that differs from the cached one.
    """
    text = template.prefix(list(messages))
    if not text:
        return [backend.bos_token] if backend.add_bos else []
    add = backend.add_bos and not (template.bos_token and text.startswith(template.bos_token))
    return backend.tokenize(text, add_special=add)


def identity_mismatch(saved: Any, current: dict[str, Any]) -> str:
    """Why a saved state does not fit this context, in one line (the resume report's reason)."""
    if not isinstance(saved, dict):
        return "saved state has no identity"
    if saved.get("model") != current.get("model"):
        return "saved state is for another model"
    if saved.get("n_ctx") != current.get("n_ctx"):
        return f"saved state is for a context of {saved.get('n_ctx')} tokens (this one: {current.get('n_ctx')})"
    kv = ("type_k", "type_v", "flash_attn")
    if any(saved.get(k) != current.get(k) for k in kv):
        def name(i: dict[str, Any]) -> str:
            return f"{i.get('type_k')}{' + flash attention' if i.get('flash_attn') else ''}"
        return f"saved state uses KV type {name(saved)}, this context {name(current)}"
    return "saved state is for other context parameters"


def cache_path(cache_dir: Path, identity: dict[str, Any], persona_hash: str, template_source: str) -> Path:
    h = hashlib.sha256()
    h.update(json.dumps(identity, sort_keys=True).encode())
    h.update(persona_hash.encode())
    h.update(hashlib.sha256(template_source.encode()).digest())
    return cache_dir / f"{h.hexdigest()[:32]}.kv"


def load_or_build(
    engine: Backend, prefix_tokens: list[int], cache_file: Path | None, identity: dict[str, Any],
) -> Generator[Event, None, tuple[list[bytes], bool]]:
    """Put the prefix cells in the (empty) engine: kept from its last conversation, else from the cache when
    valid, else evaluated and cached.

    Returns the records a conversation's state file starts with, and whether nothing was evaluated.
    """
    # Imported here: the cache keys above are computed by commands that must not load numpy (`personas`).
    from chatcli.core.kv import records as sf

    header = sf.encode_record(sf.HEADER, 0, 0, sf.header_payload(identity))
    n = len(prefix_tokens)
    if n and engine.take_kept(prefix_tokens):
        # The context's last conversation started with this prefix (``Backend.forget``): its cells are the
        # ones the cache holds (the same tokens evaluated alone, or loaded from it).
        yield Notice(f"persona prefix: {n} tokens kept in the context (not evaluated)")
        return [header, sf.encode_record(sf.CELLS, 0, n, sf.cells_payload(prefix_tokens, engine.save_cells(0, n)))], True
    if cache_file is not None and cache_file.exists() and n:
        t0 = time.perf_counter()
        record: bytes | None = None
        problem = ""
        # Mapped: one crc check per record, the cells go to llama.cpp from the mapping, and the record is
        # copied once, as it is, into the conversation's own state file (same bytes as re-encoding it).
        with sf.map_state(cache_file) as ms:
            res = ms.result
            chunks, _, n_live = res.live()
            if (res.header or {}).get("identity") == identity and n_live == n and len(chunks) == 1 \
                    and chunks[0].record.p0 == 0 and chunks[0].record.p1 == n:
                rec = chunks[0].record
                try:
                    toks, cells = ms.cells(rec)
                    try:
                        if toks == prefix_tokens:
                            engine.load_cells(0, n, cells, toks)
                            record = bytes(ms.record_bytes(rec))
                    finally:
                        cells.release()
                except Exception as exc:  # a bad cache entry is rebuilt, never fatal
                    engine.clear()
                    problem = str(exc)
        if record is not None:
            _touch(cache_file)
            ms_taken = 1000 * (time.perf_counter() - t0)
            yield Notice(f"persona prefix: {n} tokens loaded from cache in {ms_taken:.0f} ms (not evaluated)")
            return [header, record], True
        if problem:
            yield Notice(f"persona cache entry unusable ({problem}); evaluating the prefix", "warn")
    if not n:
        return [header], False  # no cells: no record (one of no cells stopped restores: ScanResult.live)
    yield from evaluate(engine, prefix_tokens, "evaluating persona prefix")
    kv = engine.save_cells(0, n)
    records = [header, sf.encode_record(sf.CELLS, 0, n, sf.cells_payload(prefix_tokens, kv))]
    if cache_file is not None:
        try:
            ensure_private_dir(cache_file.parent)
            sf.StateWriter(cache_file).rewrite(records)
            remove_stale_temp_files(cache_file.parent)  # left by a process killed while writing one
        except OSError:
            pass  # a cache that cannot be written only costs time later
    return records, False


def _touch(path: Path) -> None:
    """Mark a prefix file as used now: the state budget evicts prefix files by mtime (least recent first)."""
    try:
        os.utime(path)
    except OSError:
        pass


def effective_n_ctx(requested: int, trained: int | None) -> int:
    n = min(requested, trained) if trained else requested
    return max(256, (n + 255) // 256 * 256)  # llama.cpp pads the context to a multiple of 256
