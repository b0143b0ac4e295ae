"""The persona prefix cache as the CLI shows it: is a persona cached for the current model (without
loading it), and warming it (``chatcli personas --warm``) exactly as creating a conversation would.

Beside session.py rather than in it: importing session imports the engine (llama_cpp, numpy), and a bare
``chatcli personas`` must load neither (tests/test_imports.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from chatcli.backends.kvformat import engine_identity, kv_params_for
from chatcli.config.personas import Persona
from chatcli.config.settings import Paths, Settings
from chatcli.core.events import Event, Notice
from chatcli.core.kv import prefix
from chatcli.core.kv.prefix import effective_n_ctx
from chatcli.core.template import ChatTemplate, read_template_file
from chatcli.models.resolve import resolve_model

if TYPE_CHECKING:
    from chatcli.session import Session


def prefix_status(settings: Settings, paths: Paths, persona: Persona, session: Session | None = None) -> str:
    """"cached" or "not cached" for the current model, without loading it."""
    if session is not None:
        if session.model is None:
            return "kept by the server"  # a llama-server holds persona prefixes in its own slot files
        ref, backend_id, tmpl = session.model, session.engine.identity(), session.template.cache_key
    else:
        try:
            ref = resolve_model(settings.model)
        except Exception:
            return "no model"
        backend_id = engine_identity(effective_n_ctx(settings.n_ctx, ref.info.context_length),
                                     kv_params_for(settings.kv_type))
        src = read_template_file(settings.chat_template) if settings.chat_template else ref.info.chat_template
        tmpl = ChatTemplate(src, enable_thinking=settings.thinking).cache_key
    identity = prefix.state_identity(ref.identity(), backend_id)
    path = prefix.cache_path(paths.prefix_cache_dir, identity, persona.text_hash(), tmpl)
    return "cached" if path.exists() else "not cached"


def warm_prefix(session: Session, persona: Persona) -> Iterator[Event]:
    """Evaluate a persona's prefix into the cache (``chatcli personas --warm``), exactly as creation would."""
    engine = session.engine
    engine.clear()
    tokens = prefix.persona_prefix_tokens(engine, session.template, persona.messages())
    identity = prefix.state_identity(session.identity(), engine.identity())
    path = prefix.cache_path(session.paths.prefix_cache_dir, identity, persona.text_hash(),
                             session.template.cache_key)
    _, hit = yield from prefix.load_or_build(engine, tokens, path, identity)
    yield Notice(f"{persona.name}: {len(tokens)} prefix tokens {'already cached' if hit else 'cached'}")
    engine.clear()
