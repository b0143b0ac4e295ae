"""Builds the core objects of one chatcli process from settings: model, engine, template, store.

The CLI calls this; the REPL holds the result. Starting a conversation from another persona reuses the
same engine (one context per process, never re-created).
"""

from __future__ import annotations

import os
import secrets
import sqlite3
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from chatcli.backends.llama_server import LlamaServerBackend, ServerConfig
from chatcli.backends.llamacpp import Engine
from chatcli.config.personas import Persona, get_persona, load_personas
from chatcli.config.settings import Paths, Settings, fit_reserve
from chatcli.core.backend import Backend, Sampling
from chatcli.core.conversation import Conversation
from chatcli.core.events import Event, Notice
from chatcli.core.files.fsutil import ensure_private_dir
from chatcli.core.files.index import IndexUnavailable
from chatcli.core.files.store import ConversationStore
from chatcli.core.kv import prefix
from chatcli.core.kv.budget import Freed, enforce, prefix_bytes, resync_index, total_bytes
from chatcli.core.kv.prefix import effective_n_ctx
from chatcli.core.loading import adopt_conversation, create_conversation, open_conversation
from chatcli.core.opening import Opening
from chatcli.core.template import ChatTemplate, Message, read_template_file
from chatcli.models.resolve import ModelRef, resolve_model
from chatcli.units import parse_size


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


def chosen_template(settings: Settings, model_source: str | None,
                    remembered: tuple[str, str] | None = None) -> tuple[str | None, str | None]:
    """(template source, the file it came from): a conversation's remembered template (source, file),
    else ``settings.chat_template`` (a file), else the model's own (no file)."""
    if remembered:
        return remembered
    if settings.chat_template:
        return read_template_file(settings.chat_template), settings.chat_template
    return model_source, None


def template_notices(template: ChatTemplate, whose: str) -> list[str]:
    """What to say once about the template a process renders with."""
    out = []
    if template.is_fallback:
        out.append(f"{whose} has no chat template; using ChatML")
    if template.folds_system:
        out.append("the chat template refuses a system role: the persona is folded into the first user message")
    if template.drops_greeting:
        out.append("the chat template refuses a greeting before the first user message: the model does not see it")
    return out


@dataclass
class Session:
    """The process-wide objects: one model, one engine, one store."""

    settings: Settings
    paths: Paths
    model: ModelRef | None  # None when the model runs on a llama-server (``server``)
    engine: Engine | LlamaServerBackend
    template: ChatTemplate
    store: ConversationStore
    explicit: set[str] = field(default_factory=set)
    notices: list[str] = field(default_factory=list)
    server: str | None = None  # the llama-server URL this process talks to, if any

    @classmethod
    def build(
        cls,
        settings: Settings,
        paths: Paths,
        *,
        model: ModelRef | None = None,
        explicit: set[str] | None = None,
        progress: Callable[[float], None] | None = None,
        chat_template: tuple[str, str] | None = None,
    ) -> Session:
        """``chat_template``: the (source, file) a conversation remembers (wins over ``settings``)."""
        ref = model or resolve_model(settings.model)
        notices = []
        trained = ref.info.context_length
        n_ctx = effective_n_ctx(settings.n_ctx, trained)
        if trained and settings.n_ctx > trained:
            notices.append(f"n_ctx {settings.n_ctx} is above the model's trained context; using {n_ctx}")
        engine = Engine(ref.path, n_ctx=n_ctx, n_threads=settings.threads or None, progress=progress,
                        kv_type=settings.kv_type)
        source, origin = chosen_template(settings, ref.info.chat_template, chat_template)
        template = ChatTemplate(
            source,
            bos_token=engine.piece(engine.bos_token).decode("utf-8", "replace") if engine.bos_token >= 0 else "",
            eos_token=engine.piece(engine.eos_token).decode("utf-8", "replace") if engine.eos_token >= 0 else "",
            enable_thinking=settings.thinking,
        )
        template.origin = origin
        notices += template_notices(template, "the model")
        ensure_private_dir(paths.data_dir)
        store = ConversationStore(paths.conversations_dir)
        return cls(settings, paths, ref, engine, template, store, set(explicit or ()), notices)

    @classmethod
    def build_remote(cls, settings: Settings, paths: Paths, *, explicit: set[str] | None = None,
                     chat_template: tuple[str, str] | None = None) -> Session:
        """The same objects over a llama-server (``settings.server``): the model, its chat template and its
        tokenizer are the server's; the context size is the server's slot size."""
        assert settings.server
        backend = LlamaServerBackend(ServerConfig(
            settings.server, slot=settings.server_slot, connect_timeout=settings.server_connect_timeout,
            read_timeout=settings.server_read_timeout, api_key=settings.server_api_key))
        notices = backend.take_notices()

        def text(tok: int) -> str:
            return backend.piece(tok).decode("utf-8", "replace") if tok >= 0 else ""

        source, origin = chosen_template(settings, backend.chat_template or None, chat_template)
        template = ChatTemplate(source, bos_token=text(backend.bos_token), eos_token=text(backend.eos_token),
                                enable_thinking=settings.thinking)
        template.origin = origin
        notices += template_notices(template, "the server's model")
        ensure_private_dir(paths.data_dir)
        store = ConversationStore(paths.conversations_dir)
        return cls(settings, paths, None, backend, template, store, set(explicit or ()), notices, server=backend.url)

    @classmethod
    def open(
        cls, settings: Settings, paths: Paths, ref: str | None, *, explicit: set[str] | None = None,
        model: str | None = None, n_ctx: int | None = None, kv_type: str | None = None,
        build: Callable[[Settings, str | None, tuple[str, str] | None], Session] | None = None,
    ) -> tuple[Session, Opening[Conversation]]:
        """The session a stored conversation resumes in, and its opening: the resume policy.

        A conversation keeps what its saved KV state is valid for: its model file (only the ``model`` flag
        overrides it; CHATCLI_MODEL and the config choose the model of *new* conversations, and the
        fallback when the file is gone), its llama-server (only an explicit ``server`` setting or the
        ``model`` flag moves it), its context size (unless ``n_ctx``) and its KV type (unless ``kv_type``;
        another one rebuilds the KV from the transcript, and the open says so), its chat template and
        thinking switch (unless set explicitly). ``settings`` is adjusted in place. The conversation is
        resolved and its lock tried first, so a wrong id or a conversation
        open elsewhere fails before a model loads. ``build(settings, model_path, template)`` loads the session
        (default: ``Session.build`` / ``build_remote``; the CLI passes one that shows a spinner). The
        opening's first events are the policy's own warnings (a model that is gone, a server's notices).
        """
        explicit = set(explicit or ())
        store = ConversationStore(paths.conversations_dir)
        conv_dir = store.resolve(ref)
        meta = conv_dir.read_meta()
        conv_dir.lock()  # open in another process? say so now, not after loading the model
        conv_dir.unlock()
        saved_model = meta.get("model") or {}
        params = meta.get("params") or {}
        model_path = model
        notes: list[Notice] = []
        if "server" not in explicit:
            settings.server = None if model else saved_model.get("server")
        if settings.server:
            model_path = None
        elif not model_path:
            saved = saved_model.get("path")
            if saved and os.path.exists(saved):
                model_path = saved
            else:
                model_path = settings.model
                if saved:
                    notes.append(Notice(f"the conversation's model {saved} is gone; using "
                                        f"{settings.model or 'the default model'}", "warn"))
        if n_ctx is None:
            settings.n_ctx = int(params.get("n_ctx", settings.n_ctx))
            fit_reserve(settings, explicit)
        saved_kv = str(params.get("type_k", "f16"))
        if kv_type is None and saved_kv in ("f16", "q8_0", "q4_0"):
            settings.kv_type = saved_kv
        # It keeps the template it started with (and its thinking switch); only flags or the environment
        # change them. The config file's choice is for new conversations.
        remembered = None
        tmpl_meta = meta.get("chat_template")
        if "chat_template" not in explicit:
            settings.chat_template = None
            if isinstance(tmpl_meta, dict) and isinstance(tmpl_meta.get("source"), str):
                remembered = (str(tmpl_meta["source"]), str(tmpl_meta.get("file", "")))
        if "thinking" not in explicit:
            saved_thinking = meta.get("thinking")
            settings.thinking = saved_thinking if isinstance(saved_thinking, bool) else None
        if build is None:
            def build(s: Settings, path: str | None, template: tuple[str, str] | None) -> Session:
                if s.server:
                    return cls.build_remote(s, paths, explicit=explicit, chat_template=template)
                return cls.build(s, paths, model=resolve_model(path or s.model), explicit=explicit,
                                 chat_template=template)
        session = build(settings, model_path, remembered)
        if session.server:
            notes += [Notice(n, "warn") for n in session.notices]
        return session, session.open_conversation(conv_dir.id).before(notes)

    @property
    def local_model(self) -> ModelRef:
        """The local model file (front ends that need one, such as ``chatcli serve``, refuse ``--server``)."""
        if self.model is None:
            raise ValueError("this needs a local model: not available with --server")
        return self.model

    @property
    def local_engine(self) -> Engine:
        if not isinstance(self.engine, Engine):
            raise ValueError("this needs the local engine: not available with --server")
        return self.engine

    def new_context(self) -> Backend:
        """Another context over the session's model: its own KV cache and tokens, the weights loaded once
        (``Engine.sibling``), for a conversation resident beside others (``serve --parallel``). Close it
        before the session. Not available with ``--server`` (ValueError)."""
        return self.local_engine.sibling()

    def prepare_batching(self) -> bool:
        """Make the shared batch context of the contexts made so far (``Engine.prepare_batching``): call it
        once they all exist, so the first requests that generate at once do not wait for it."""
        return self.local_engine.prepare_batching()

    @property
    def model_name(self) -> str:
        if self.model is not None:
            return self.model.info.name
        assert isinstance(self.engine, LlamaServerBackend)
        return f"{self.engine.identity()['model']} on {self.server}"

    def identity(self) -> dict[str, Any]:
        if self.model is not None:
            return self.model.identity()
        # What a conversation records as its model: the server it ran on (so ``resume`` finds it again) and
        # the model the server reported. The context size is part of the backend's identity.
        assert isinstance(self.engine, LlamaServerBackend)
        ident = self.engine.identity()
        return {"server": self.server, **{k: ident[k] for k in ("model", "model_size", "n_params", "n_vocab", "ftype")}}

    def personas(self) -> dict[str, Persona]:
        return load_personas(self.paths.personas_dir)

    def new_conversation(self, persona_name: str, *, seed: int | None = None, keep: bool = False) -> Opening[Conversation]:
        """A new conversation from persona ``persona_name``; ``keep``: see ``Conversation.start``."""
        persona = get_persona(persona_name, self.paths.personas_dir)
        s = self.settings
        return self._budgeted(create_conversation(
            self.store, self.engine, self.template,
            persona_name=persona.name, persona_messages=persona.messages(), persona_hash=persona.text_hash(),
            identity=self.identity(), model_path=self._model_path(),
            sampling=sampling_from(s, persona, self.explicit),
            seed=seed if seed is not None else (s.seed if s.seed is not None else secrets.randbits(31)),
            prefix_cache_dir=ensure_private_dir(self.paths.prefix_cache_dir),
            max_tokens=self._max_tokens(persona), reserve=s.reserve, extra_meta=self.template_meta(), keep=keep,
        ))

    def _model_path(self) -> str:
        """What a new conversation records as its model's file: the local file, or the llama-server's URL."""
        return str(self.model.path) if self.model is not None else str(self.server)

    def template_meta(self) -> dict[str, Any]:
        """What a new conversation remembers of its template beyond the model: a template file used instead
        of the model's (its text, so a later edit of the file cannot change a conversation's turns) and
        the thinking switch. Nothing when neither is set, as before either existed."""
        out: dict[str, Any] = {}
        if self.template.origin is not None:
            out["chat_template"] = {"file": self.template.origin, "source": self.template.source}
        if self.template.enable_thinking is not None:
            out["thinking"] = self.template.enable_thinking
        return out

    def _max_tokens(self, persona: Persona | None) -> int:
        if persona is not None and "max_tokens" in dict(persona.sampling) and "max_tokens" not in self.explicit:
            return int(dict(persona.sampling)["max_tokens"])
        return self.settings.max_tokens

    def open_conversation(self, ref: str | None, *, backend: Backend | None = None, sampling: Sampling | None = None,
                          max_tokens: int | None = None) -> Opening[Conversation]:
        """Resume a stored conversation in ``backend`` (default: the session's engine; the server passes one
        of its contexts). ``sampling`` and ``max_tokens`` default to the settings and the conversation's
        persona file; given both (the server's per-request values), the persona file is not read."""
        conv_dir = self.store.resolve(ref)
        persona = None
        if sampling is None or max_tokens is None:
            meta = conv_dir.read_meta()
            try:
                persona = get_persona(str(meta.get("persona", "")), self.paths.personas_dir)
            except Exception:
                persona = None  # a deleted persona file must not make a conversation unopenable
        return self._budgeted(open_conversation(
            self.store, conv_dir.id, backend or self.engine, self.template, identity=self.identity(),
            sampling=sampling or sampling_from(self.settings, persona, self.explicit),
            max_tokens=self._max_tokens(persona) if max_tokens is None else max_tokens, reserve=self.settings.reserve,
            persona_messages=persona.messages() if persona is not None else None,
        ))

    def new_conversation_from(
        self, persona: Sequence[Message], *, persona_name: str, persona_hash: str, seed: int, sampling: Sampling,
        max_tokens: int, meta: Mapping[str, Any], backend: Backend | None = None, keep: bool = False,
    ) -> Opening[Conversation]:
        """A new conversation whose persona is given as messages (a request's system message), not a
        persona file: its prefix comes from the shared prefix cache when one matches ``persona_hash``.
        ``meta``: fields merged into its metadata (whose it is). ``keep``: see ``Conversation.start``.

        ``meta`` goes into the first metadata write, with the template's (as ``new_conversation``'s): a
        separate write after the prefix cost one more atomic write (two fsyncs, 1-2 ms before the first
        token), and a crash between the two left an API client's conversation without its owner."""
        return self._budgeted(create_conversation(
            self.store, backend or self.engine, self.template,
            persona_name=persona_name, persona_messages=list(persona), persona_hash=persona_hash,
            identity=self.identity(), model_path=self._model_path(), sampling=sampling, seed=seed,
            prefix_cache_dir=ensure_private_dir(self.paths.prefix_cache_dir), max_tokens=max_tokens,
            reserve=self.settings.reserve, extra_meta={**self.template_meta(), **meta}, keep=keep,
        ))

    def adopt(self, backend: Backend, cid: str, *, sampling: Sampling, max_tokens: int) -> Conversation | None:
        """Open ``cid`` from what ``backend`` holds already (``core.loading.adopt_conversation``: a fork of
        the conversation resident there), or None; it gets the state budget hook like every other."""
        conv = adopt_conversation(self.store, cid, backend, self.template, identity=self.identity(),
                                  sampling=sampling, max_tokens=max_tokens, reserve=self.settings.reserve)
        if conv is not None:
            adopted = conv
            adopted.after_save = lambda: self.budget_notice([adopted])
        return conv

    # -- state budget ---------------------------------------------------------------------------------

    def _budgeted(self, opening: Opening[Conversation]) -> Opening[Conversation]:
        """The opening, then the budget hook given to its conversation and applied once right away (opening
        may have written a whole state file): every conversation a session opens has it."""
        def budget(conv: Conversation) -> Iterator[Event]:
            text = self.attach_budget(conv)
            if text:
                yield Notice(text)

        return opening.then(budget)

    def attach_budget(self, conv: Conversation) -> str | None:
        """Give ``conv`` the state-budget hook (every later state write applies the budget) and apply it
        once now; returns the line to show, if any. Other conversations this process has open are spared by
        their locks (``flock`` refuses a second file description of the same process too)."""
        conv.after_save = lambda: self.budget_notice([conv])
        return conv.after_save()

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
        convs = list(open_convs)
        total = self._running_total(convs)
        if total <= limit:
            return None
        prefixes = [prefix.cache_path(self.paths.prefix_cache_dir, c.state_identity(),
                                      str(c.meta.get("persona_hash", "")), self.template.cache_key) for c in convs]
        freed = enforce(self.paths.conversations_dir, self.paths.prefix_cache_dir, limit,
                        keep_ids=[c.id for c in convs], keep_prefixes=prefixes)
        # The rescan (over budget: rare) is also when the running total is set right again, whatever
        # wrote state files behind the index's back (another chatcli version, a copy).
        resync_index(self.store.index, self.paths.conversations_dir)
        return freed

    def _running_total(self, convs: list[Conversation]) -> int:
        """Bytes of all KV state: the index's running total, updated with the open conversations' files
        (constant cost per turn, however many conversations there are), plus the persona prefix files
        (a few). Without an index, every folder is listed."""
        index = self.store.index
        if index is not None:
            try:
                for c in convs:
                    index.note_state(c.dir)
                return index.state_total() + prefix_bytes(self.paths.prefix_cache_dir)
            except (sqlite3.Error, IndexUnavailable):
                pass
        return total_bytes(self.paths.conversations_dir, self.paths.prefix_cache_dir)

    def close(self) -> None:
        self.engine.close()
