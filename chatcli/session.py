"""Builds the core objects of one chatcli process from settings: model, engine, template, store.

The CLI calls this; the REPL holds the result. Starting a conversation from another persona reuses the
same engine (one context per process, never re-created).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from chatcli.backends.llamacpp import Engine
from chatcli.core import prefixcache
from chatcli.core.budget import Freed, enforce, parse_size, total_bytes
from chatcli.config.personas import Persona, get_persona, load_personas
from chatcli.config.settings import Paths, Settings, ensure_dir
from chatcli.core.backend import Sampling
from chatcli.core.conversation import Conversation
from chatcli.core.events import Event, Notice, ResumeReport
from chatcli.core.prefixcache import effective_n_ctx
from chatcli.core.store import ConversationStore
from chatcli.core.template import ChatTemplate
from chatcli.models.resolve import ModelRef, resolve_model


def sampling_from(settings: Settings, persona: Persona | None = None, explicit: set[str] | None = None) -> Sampling:
    """Settings win over a persona's sampling defaults only where the user set them explicitly."""
    values: dict[str, Any] = {
        "temperature": settings.temperature, "top_p": settings.top_p,
        "top_k": settings.top_k, "repeat_penalty": settings.repeat_penalty,
    }
    if persona is not None:
        for key, val in dict(persona.sampling).items():
            if key in values and key not in (explicit or set()):
                values[key] = val
    return Sampling(
        temperature=float(values["temperature"]), top_p=float(values["top_p"]),
        top_k=int(values["top_k"]), repeat_penalty=float(values["repeat_penalty"]),
    )


@dataclass
class Session:
    """The process-wide objects: one model, one engine, one store."""

    settings: Settings
    paths: Paths
    model: ModelRef
    engine: Engine
    template: ChatTemplate
    store: ConversationStore
    explicit: set[str] = field(default_factory=set)
    notices: list[str] = field(default_factory=list)

    @classmethod
    def build(
        cls,
        settings: Settings,
        paths: Paths,
        *,
        model: ModelRef | None = None,
        explicit: set[str] | None = None,
        progress: Callable[[float], None] | None = None,
    ) -> Session:
        ref = model or resolve_model(settings.model)
        notices = []
        trained = ref.info.context_length
        n_ctx = effective_n_ctx(settings.n_ctx, trained)
        if trained and settings.n_ctx > trained:
            notices.append(f"n_ctx {settings.n_ctx} is above the model's trained context; using {n_ctx}")
        engine = Engine(ref.path, n_ctx=n_ctx, n_threads=settings.threads or None, progress=progress,
                        kv_type=settings.kv_type)
        tmpl_src = ref.info.chat_template
        template = ChatTemplate(
            tmpl_src,
            bos_token=engine.piece(engine.bos_token).decode("utf-8", "replace") if engine.bos_token >= 0 else "",
            eos_token=engine.piece(engine.eos_token).decode("utf-8", "replace") if engine.eos_token >= 0 else "",
        )
        if template.is_fallback:
            notices.append("the model has no chat template; using ChatML")
        ensure_dir(paths.data_dir)
        store = ConversationStore(paths.conversations_dir)
        return cls(settings, paths, ref, engine, template, store, set(explicit or ()), notices)

    def identity(self) -> dict[str, Any]:
        return self.model.identity()

    def personas(self) -> dict[str, Persona]:
        return load_personas(self.paths.personas_dir)

    def new_conversation(self, persona_name: str, *, seed: int | None = None) -> Iterator[Event | Conversation]:
        persona = get_persona(persona_name, self.paths.personas_dir)
        s = self.settings
        yield from self._budgeted(Conversation.create(
            self.store, self.engine, self.template,
            persona_name=persona.name, persona_messages=persona.messages(), persona_hash=persona.text_hash(),
            identity=self.identity(), model_path=str(self.model.path),
            sampling=sampling_from(s, persona, self.explicit),
            seed=seed if seed is not None else (s.seed if s.seed is not None else secrets.randbits(31)),
            prefix_cache_dir=ensure_dir(self.paths.prefix_cache_dir),
            max_tokens=self._max_tokens(persona), reserve=s.reserve,
        ))

    def _max_tokens(self, persona: Persona | None) -> int:
        if persona is not None and "max_tokens" in dict(persona.sampling) and "max_tokens" not in self.explicit:
            return int(dict(persona.sampling)["max_tokens"])
        return self.settings.max_tokens

    def open_conversation(self, ref: str | None) -> Iterator[Event | ResumeReport | Conversation]:
        conv_dir = self.store.resolve(ref)
        meta = conv_dir.read_meta()
        persona = None
        try:
            persona = get_persona(str(meta.get("persona", "")), self.paths.personas_dir)
        except Exception:
            persona = None  # a deleted persona file must not make a conversation unopenable
        yield from self._budgeted(Conversation.open(
            self.store, conv_dir.id, self.engine, self.template, identity=self.identity(),
            sampling=sampling_from(self.settings, persona, self.explicit),
            max_tokens=self._max_tokens(persona), reserve=self.settings.reserve,
            persona_messages=persona.messages() if persona is not None else None,
        ))

    # -- state budget ---------------------------------------------------------------------------------

    def _budgeted(self, events: Iterator[Any]) -> Iterator[Any]:
        """Pass the events through; the opened conversation gets the budget hook, applied once right away
        (opening may have written a whole state file)."""
        for ev in events:
            if isinstance(ev, Conversation):
                conv = ev
                conv.after_save = lambda: self.budget_notice([conv])
                text = conv.after_save()
                if text:
                    yield Notice(text)
            yield ev

    def budget_notice(self, open_convs: Iterable[Conversation]) -> str | None:
        """The line to show after a save, or None. Nothing is said when nothing could be dropped (only the
        open conversation is over budget): a line after every turn would be noise; `chatcli ls` shows it."""
        freed = self.keep_budget(open_convs)
        return freed.summary() if freed is not None and freed.evicted else None

    def keep_budget(self, open_convs: Iterable[Conversation] = ()) -> Freed | None:
        """After a save: if all KV state now exceeds ``state_budget``, drop the least recently used state
        files (never ``open_convs``, other open conversations or their persona prefixes). None when within
        budget, so the caller shows nothing."""
        limit = parse_size(self.settings.state_budget)
        if limit is None:
            return None
        if total_bytes(self.paths.conversations_dir, self.paths.prefix_cache_dir) <= limit:
            return None
        convs = list(open_convs)
        prefixes = [prefixcache.cache_path(self.paths.prefix_cache_dir, c.state_identity(),
                                           str(c.meta.get("persona_hash", "")), self.template.source) for c in convs]
        return enforce(self.paths.conversations_dir, self.paths.prefix_cache_dir, limit,
                       keep_ids=[c.id for c in convs], keep_prefixes=prefixes)

    def close(self) -> None:
        self.engine.close()
