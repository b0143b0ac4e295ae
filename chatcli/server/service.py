"""The server's service layer: a request's message list → a conversation, continued without re-ingesting.

No HTTP here: the app calls ``ChatService.complete`` (an iterator of ``Started``, ``Delta``, ``Finished``)
in a worker thread. Per request:

1. the messages are split into persona + turns (``history``) and keyed;
2. the index gives the stored conversation with the longest common history, and the boundary matched;
3. that conversation is continued when the match is its end (restored from its state file unless it is
   the resident one), else *forked* at the boundary (its KV records copied; the original untouched), else
   a new conversation starts from the persona prefix (shared prefix cache);
4. messages after the boundary are appended — the last user message through ``Conversation.send``, exactly
   as a REPL turn (transcript first, then the turn's cells and logits); a history that ends at a stored
   user message is "regenerate": its reply is sampled from the saved logits, 0 tokens evaluated.

One engine, one resident sequence: requests are served one at a time under a lock (others wait in their
worker threads); switching conversations restores from disk; a conversation's lock is held only while
a request runs on it, so ``chatcli resume`` can take over any conversation between requests.
"""

from __future__ import annotations

import contextlib
import functools
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from chatcli.core.backend import Backend, BackendError, GrammarError, Sampling
from chatcli.core.conversation import Conversation
from chatcli.core.events import (
    ConversationError,
    MessageTooLongError,
    Notice,
    Progress,
    ReplyEnd,
    ReplyStart,
    ReplyText,
)
from chatcli.core.files.migrations import FormatError
from chatcli.core.files.store import ConversationDir, LockedError, StoreError
from chatcli.core.forking import fork_after
from chatcli.core.kv.prefix import persona_prefix_tokens
from chatcli.core.opening import Opening
from chatcli.core.steps import drain
from chatcli.core.template import Message, stop_prefix_at_end
from chatcli.core.transcript import replay_events
from chatcli.errors import ChatcliError, DoesNotFitError, Kind
from chatcli.server import history
from chatcli.server.history import HistoryError, SplitHistory
from chatcli.server.index import REPL_OWNER, Entry, PrefixIndex, conversation_keys, owner_of
from chatcli.server.response_format import JsonReply
from chatcli.session import Session

_TURN_OVERHEAD = 8  # template tokens around one message (ChatML: 5), rounded up: the fit test errs on the safe side
API_PERSONA = "(api)"  # persona name of conversations whose prefix came from a request's system message
KV_STAMP = 4  # the first entries of ``_stamp``: transcript and state file (what the resident KV depends on)


class OpenCancelled(Exception):
    """Opening stopped between two batches because the request's client went away."""


class ServiceError(ChatcliError):
    """A request the service refuses; ``kind`` says which (``server.errors.from_error`` gives the status)."""

    def __init__(self, kind: Kind, message: str, param: str | None = None) -> None:
        super().__init__(message, kind=kind)
        self.param = param


@dataclass
class ChatRequest:
    messages: list[Message]
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repeat_penalty: float | None = None
    max_tokens: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    conversation: str | None = None  # continue this conversation (else: found by the index)
    client: str = ""  # the API client's namespace (its key's id; "" without keys): it meets only its own
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    json_reply: JsonReply | None = None  # the reply must be JSON (response_format; None: any text)


@dataclass
class Started:
    conversation: str
    forked_from: str | None
    prompt_tokens: int  # tokens in the context when the reply starts
    evaluated: int  # of which this request evaluated (the rest came from memory or disk)
    state: str = ""  # where the rest came from: memory | disk | fork | new

    @property
    def cached_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.evaluated)


@dataclass
class Delta:
    text: str
    reasoning: bool = False  # a piece of the reply's reasoning (``reasoning_content``), not of its answer


@dataclass
class Finished:
    conversation: str
    forked_from: str | None
    text: str
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    evaluated: int
    completion_tokens: int
    notices: list[str] = field(default_factory=list)
    shifted: int = 0  # messages that left the context during this request (context shift)
    state: str = ""  # memory | disk | fork | new (see Started)
    reasoning: str = ""  # the reply's reasoning, returned apart from its answer (``text``)
    # The request's new messages as evaluated (llama-server's ``timings``): tokens and seconds; the reply's
    # sampling and decoding, first token to last (``decode_seconds``, as llama-server's ``predicted_ms``
    # and talk's tok/s count it; ``gen_seconds`` adds the first token's wait and the last token's decode).
    prompt_n: int = 0
    prompt_seconds: float = 0.0
    gen_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def cached_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.evaluated)


ServiceEvent = Started | Delta | Finished


@dataclass
class _Slot:
    """One context of the pool and the conversation resident in it (its KV is what the context holds)."""

    engine: Backend
    conv: Conversation | None = None
    stamp: tuple[int, ...] = ()
    used: float = 0.0
    busy: bool = False  # a request is running on this context
    # Its reply was answered ([DONE] on its way) and its state is being written: a request for the same
    # conversation waits for that (``_await_finishing``) instead of finding it locked.
    finishing: bool = False


@dataclass
class _Req:
    """What one request holds: its context, that context's evaluation counter when taken, where the
    conversation's state came from."""

    slot: _Slot | None = None
    ev0: int = 0
    how: str = ""

    @property
    def evaluated(self) -> int:
        return self.slot.engine.n_evaluated_total - self.ev0 if self.slot is not None else 0


@dataclass
class _Prepared:
    conv: Conversation
    created: bool
    forked_from: str | None
    tail: Sequence[Message]
    seed: int


class ChatService:
    """Chat completions over stored conversations; thread-safe (requests come from worker threads).

    One lock guards the index and the pool; it is held while a request finds and restores its
    conversation, not while it evaluates and generates: requests on different contexts (``parallel``)
    run at the same time, each on the context it took; with every context busy, a request waits.
    """

    def __init__(self, session: Session, *, parallel: int = 1, index_path: Path | None = None,
                 repl_access: bool = False) -> None:
        self.session = session
        self.repl_access = repl_access  # REPL conversations can be matched, named and forked from the API
        self.engine = session.engine
        self.store = session.store
        self.index = PrefixIndex(
            session.store, index_path or session.paths.data_dir / "server" / "index.json",
            model_identity=session.identity(), n_ctx=session.engine.n_ctx, template_source=session.template.cache_key,
        )
        self._cond = threading.Condition()
        with self._cond:
            self.index.refresh()
        # ``parallel`` contexts over the one model: that many conversations stay resident; switching among
        # them restores nothing. The least recently used is released (its state is already on disk).
        model = session.local_model
        self._slots = [_Slot(session.engine)] + [_Slot(session.new_context()) for _ in range(parallel - 1)]
        if parallel > 1:
            # Now, not under the model's lock in the first two requests that generate at once. A context that
            # cannot be made (memory) is tried again then, and refused there as it was before.
            with contextlib.suppress(BackendError):
                session.prepare_batching()
        self.parallel = parallel
        self.model_name = model.info.name or Path(str(model.path)).stem  # for people: the GGUF's general.name
        # For clients (``GET /v1/models``, the responses' ``model``): the file's stem, as llama-server names a
        # model by its file, so an id can be typed (general.name often has spaces). Any name is accepted.
        self.model_id = Path(str(model.path)).stem
        # A message's text tokens, for the fit tests (``_check_fits``, then ``_tail_fits`` in every request
        # that resends it: a client resends its whole history each turn): counted once, not once per request
        # and boundary (measured 7 ms of a 12-turn request).
        self._n_tokens: Callable[[str], int] = functools.lru_cache(maxsize=4096)(
            lambda text: len(self.engine.tokenize(text, add_special=False)))

    # -- the one operation ------------------------------------------------------------------------------

    def complete(self, req: ChatRequest, *, cancelled: Callable[[], bool] = lambda: False) -> Iterator[ServiceEvent]:
        """Serve one chat completion. Closing the iterator early records the reply so far (like Ctrl-C).

        ``cancelled`` says the client went away: it is asked between evaluated batches of the prompt (a
        long history is not read for nobody); the iterator then ends without a reply, the message being
        read taken back out, the ones before it kept.
        """
        rq = _Req()
        try:
            with self._cond:
                # A context whose request is finishing (its end sent, its state being written) is free in a few
                # milliseconds: this request finds its conversation meanwhile and waits where it takes a
                # context (``_await_free``), so a client's next turn is not parsed and matched after the
                # previous turn's commit but during it (serve_timeline at --parallel 1: the commit is ~7 ms).
                while all(s.busy and not s.finishing for s in self._slots):
                    self._cond.wait()
                prep = self._prepare(req, rq, cancelled)
            yield from self._run(req, rq, prep, cancelled)
        except OpenCancelled:
            return  # the client left while its conversation was being restored: no reply, nothing kept
        except LockedError:
            # Not the store's message: it names the process holding the lock, nothing a client should see.
            raise ServiceError("conflict", "the conversation is in use (by another request or a chatcli "
                               "process): retry later") from None
        except StoreError:
            # The store's messages name folders and other ids: a client is told only that it is gone.
            raise ServiceError("not_found", "the conversation is no longer available", "conversation") from None
        except ChatcliError as exc:  # the app answers it with the status its kind gives (server.errors)
            if exc.kind == "engine":
                with self._cond:
                    if rq.slot is not None:
                        rq.slot.conv = None  # what its context holds is unknown now: restore next time
            raise
        finally:
            with self._cond:
                self._give_back(rq)

    def _prepare(self, req: ChatRequest, rq: _Req, cancelled: Callable[[], bool]) -> _Prepared:
        """Under the lock: find the conversation, take a context, restore or fork into it."""
        self.index.refresh(save=False)  # saved after the reply (``_release``), not before its first token
        owners = self._owners(req)
        sh, explicit = self._split(req, owners)
        root = self.index.root(sh.persona)
        keys = history.chain(root, sh.turns)
        i, entries = self.index.lookup(root, keys, only=explicit, owners=owners)
        if explicit is not None and i < 0:
            raise ServiceError("conflict", f"conversation {explicit} was made with another model or context size")
        if explicit is None:
            i, entries = self._choose(root, keys, i, entries, owners, self._tail_fits(sh))
        self._check_fits(sh, max(i, 0))
        sampling = self._sampling(req)
        max_tokens = req.max_tokens or self.session.settings.max_tokens
        conv, created, forked_from, tail = self._acquire(sh, root, keys, i, entries, sampling, max_tokens,
                                                         explicit, rq, owners, self._new_meta(req), cancelled)
        conv.set_options(sampling=sampling, max_tokens=max_tokens, extra_stop=req.stop)
        # The reply's end goes to the client before its cells and the metadata are written (``_release``
        # writes them, the context still this request's): the transcript line, the truth, is on disk first.
        conv.defer_writes()
        seed = req.seed if req.seed is not None else secrets.randbits(31)
        return _Prepared(conv, created, forked_from, tail, seed)

    def _run(self, req: ChatRequest, rq: _Req, prep: _Prepared,
             cancelled: Callable[[], bool]) -> Iterator[ServiceEvent]:
        """Without the lock: append the new messages and generate, on the context this request holds."""
        conv, tail = prep.conv, prep.tail
        shifted0 = len(conv.out_of_context)
        notices: list[str] = []
        t_app, n_app = time.perf_counter(), conv.context.n_past
        try:
            for m in tail[:-1]:
                # A message of the client's history, added without generating (closing early takes it back).
                steps = conv.append_user(m.content) if m.role == "user" else conv.append_reply(m.content)
                for _ in steps:
                    if cancelled():
                        try:
                            _close(steps)  # this message is taken back out; the ones before it stay
                        finally:
                            self._gone(conv, rq, prep)
                        return
            if cancelled():
                self._gone(conv, rq, prep)
                return
            # No new message: the history ends at a stored user message, whose reply is generated (from the
            # logits saved after it: 0 tokens evaluated).
            gen = conv.send(tail[-1].content, seed=prep.seed) if tail else conv.regen(seed=prep.seed)
            t_app, n_app = time.perf_counter() - t_app, conv.context.n_past - n_app
        except DoesNotFitError:
            self._abandon(conv, rq, remove=prep.created)
            raise
        except BaseException:
            self._abandon(conv, rq, remove=False)
            raise
        started: Started | None = None
        end: ReplyEnd | None = None
        raw = emitted = ""
        stops = conv.stop_strings
        try:
            for ev in gen:
                if isinstance(ev, Progress) and ev.stoppable and cancelled():
                    try:
                        _close(gen)  # between two batches of the prompt: the message is taken back out
                    finally:
                        self._gone(conv, rq, prep)
                    return
                if isinstance(ev, Notice):
                    notices.append(ev.text)
                elif isinstance(ev, ReplyStart):
                    started = Started(conv.id, prep.forked_from, conv.context.n_past, rq.evaluated, rq.how)
                    yield started
                elif isinstance(ev, ReplyText) and ev.reasoning:
                    yield Delta(ev.text, reasoning=True)
                elif isinstance(ev, ReplyText):
                    raw += ev.text
                    safe = _safe_prefix(raw, stops)
                    if len(safe) > len(emitted):
                        yield Delta(safe[len(emitted):])
                        emitted = safe
                elif isinstance(ev, ReplyEnd):
                    end = ev
        except DoesNotFitError:
            try:
                _close(gen)
            finally:
                self._abandon(conv, rq, remove=prep.created and started is None)
            raise
        except BaseException:
            # A consumer that went away: the reply so far is recorded like a Ctrl-C'd one. Recording can
            # fail (disk full); the conversation's lock and context are given back either way.
            try:
                _close(gen)
            finally:
                self._release(conv, rq)
            raise
        # Indexed before the end is sent (the next request finds this reply); the state is written after it.
        with self._cond:
            self.index.update(conv)
            if rq.slot is not None:
                rq.slot.conv = conv
                rq.slot.finishing = True
        try:
            assert started is not None and end is not None
            text = end.message.shown
            if text.startswith(emitted) and len(text) > len(emitted):
                yield Delta(text[len(emitted):])
            reason = "length" if end.stats.stop_reason in ("length", "context") else "stop"
            st = end.stats
            yield Finished(conv.id, prep.forked_from, text, reason, started.prompt_tokens, started.evaluated,
                           st.n_generated, notices, len(conv.out_of_context) - shifted0, rq.how,
                           end.message.reasoning, prompt_n=n_app + st.n_prompt,
                           prompt_seconds=t_app + st.prompt_seconds, gen_seconds=st.gen_seconds,
                           decode_seconds=st.decode_seconds)
        finally:
            self._release(conv, rq, indexed=True)

    # -- steps ------------------------------------------------------------------------------------------

    def _owners(self, req: ChatRequest) -> frozenset[str]:
        """Whose conversations this request may match, name or fork: its client's, and the REPL's only
        when the server was told to share them (``api_repl_access``)."""
        own = "api:" + req.client
        return frozenset({own, REPL_OWNER}) if self.repl_access else frozenset({own})

    @staticmethod
    def _new_meta(req: ChatRequest) -> dict[str, str]:
        """Metadata of a conversation this request creates (new or forked): whose it is."""
        return {"source": "api", **({"api_client": req.client} if req.client else {})}

    def _split(self, req: ChatRequest, owners: frozenset[str]) -> tuple[SplitHistory, str | None]:
        msgs = history.normalize(req.messages)
        if req.conversation is None:
            return history.split(msgs, self.index.personas(owners)), None
        # A whole id of one of this client's conversations, else 404 — the same answer whether it exists
        # for someone else, is a prefix of several ids, or does not exist: a client learns nothing of others.
        gone = ServiceError("not_found", "no such conversation (name one of yours by its whole id)", "conversation")
        try:
            self.store.validate_id(req.conversation)
        except StoreError:
            raise gone from None
        conv_dir = self.store.dir(req.conversation)
        try:
            meta = conv_dir.read_meta()
        except (StoreError, FormatError):
            raise gone from None
        if owner_of(meta) not in owners:
            raise gone
        r = replay_events(conv_dir.read_transcript().events)
        persona = tuple(r.persona_messages)
        if persona and tuple(msgs[:len(persona)]) == persona:
            msgs = msgs[len(persona):]
        sh = history.split(msgs)
        if sh.persona:
            raise HistoryError(f"the messages before the first user message differ from conversation "
                               f"{conv_dir.id}'s persona: send its persona messages exactly, or none", "messages")
        return SplitHistory(persona, sh.turns), conv_dir.id

    def _check_fits(self, sh: SplitHistory, start: int) -> None:
        """Refuse before anything is written when a new message cannot fit the context even alone."""
        eng = self.engine
        room = eng.n_ctx - self.session.settings.reserve
        for n, m in enumerate(sh.turns[start:], start=start):
            if m.role == "user" and self._n_tokens(m.content) >= room:
                raise MessageTooLongError(
                    f"message {len(sh.persona) + n} is longer than the context allows "
                    f"(n_ctx {eng.n_ctx}, {self.session.settings.reserve} kept for the reply)")

    def _check_persona_fits(self, sh: SplitHistory) -> None:
        """A new conversation's persona prefix must leave room for a message and the reply: checked before
        its folder is made (a prefix that fails to fit left a folder behind, and the next identical request
        then met that folder and another error)."""
        eng = self.engine
        n = len(persona_prefix_tokens(eng, self.session.template, list(sh.persona)))
        if n >= eng.n_ctx - self.session.settings.reserve:
            raise MessageTooLongError(
                f"the messages before the first user message are {n} tokens, longer than the context allows "
                f"(n_ctx {eng.n_ctx}, {self.session.settings.reserve} kept for the reply)")

    def _sampling(self, req: ChatRequest) -> Sampling:
        """The request's sampling, checked against the model before anything is written."""
        s = self.session.settings
        n_vocab = self.engine.n_vocab
        for tok, _bias in req.logit_bias:
            if not 0 <= tok < n_vocab:
                raise ServiceError("usage", f"logit_bias: token {tok} is not in the vocabulary "
                                   f"(0..{n_vocab - 1})", "logit_bias")
        grammar = ""
        if req.json_reply is not None:
            try:
                grammar = self.engine.json_grammar(req.json_reply.schema)
            except GrammarError as exc:
                raise ServiceError("usage", f"response_format: {exc}", "response_format") from None
        return Sampling(
            temperature=s.temperature if req.temperature is None else req.temperature,
            top_p=s.top_p if req.top_p is None else req.top_p,
            top_k=s.top_k if req.top_k is None else req.top_k,
            repeat_penalty=s.repeat_penalty if req.repeat_penalty is None else req.repeat_penalty,
            min_p=req.min_p or 0.0, presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0, logit_bias=req.logit_bias, grammar=grammar,
        )

    def _warm(self, cid: str) -> bool:
        """The conversation's KV can be had without evaluating it: it has a state file. A cold one (its
        state file evicted by ``chatcli gc`` or the state budget) rebuilds its whole context from the
        transcript, even when it is resident (its stamp changed: ``_open`` restores it)."""
        try:
            return self.store.dir(cid).state_size() > 0
        except OSError:
            return False

    def _tail_fits(self, sh: SplitHistory) -> Callable[[int, int], bool]:
        """``fits(j, pos)``: the request's messages after boundary ``j``, appended to a state of ``pos``
        tokens, leave the reply its reserve. Appended messages never shift the context (only the last
        message's send does), so a boundary whose remaining history does not fit cannot be continued.
        An estimate from above: each message's text tokens plus the template's few around it."""
        eng, reserve, n_tokens = self.engine, self.session.settings.reserve, self._n_tokens
        sizes: dict[int, int] = {len(sh.turns): 0}

        def size(j: int) -> int:
            # Suffix sums, each from the nearest one known (``_choose`` asks for boundaries from the last one
            # back): each message is counted once per request, not once per boundary after it.
            if j >= len(sh.turns):
                return 0
            if j not in sizes:
                k = min(x for x in sizes if x > j)
                sizes[j] = sizes[k] + sum(n_tokens(m.content) + _TURN_OVERHEAD for m in sh.turns[j:k])
            return sizes[j]

        return lambda j, pos: pos + size(j) + reserve <= eng.n_ctx

    def _choose(self, root: str, keys: list[str], i: int, entries: list[Entry],
                owners: frozenset[str], fits: Callable[[int, int], bool]) -> tuple[int, list[Entry]]:
        """The boundary to continue from and the conversations holding it, by the tokens the request will
        evaluate: a warm conversation saves its matched prefix, a cold one saves nothing (it is rebuilt
        whole). So the longest match loses to a shorter one only when it is cold and the shorter is warm.

        When no warm conversation matches beyond the persona: a cold one whose end is the match is still
        continued (it becomes warm again; a new conversation would save only the persona prefix and
        duplicate the history), but a cold one is never forked: a new conversation from the cached persona
        prefix evaluates less than a fork that rebuilds everything.

        Only boundaries whose remaining history fits are options (``fits``); a conversation's own end
        always is (its last message is sent, which shifts the context when it must).
        """
        if i <= 0:
            return i, entries
        options: list[tuple[int, int, Entry]] = []  # (tokens saved, boundary, entry)
        j, ents = i, entries
        warm = functools.cache(self._warm)  # a conversation is met at each of its boundaries: one stat each
        while j >= 1:
            options += [(e.pos if warm(e.conv) else 0, j, e) for e in ents
                        if (j == i and e.end) or fits(j, e.pos)]
            j, ents = self.index.lookup(root, keys[:j - 1], owners=owners)
        saved, j = max(((o[0], o[1]) for o in options), default=(0, 0))  # ties: the longer match
        if saved > 0:
            return j, [o[2] for o in options if o[1] == j]  # _acquire tries the warm ones first
        if any(e.end for e in entries):
            return i, [e for e in entries if e.end]  # not a sibling at i whose tail did not fit
        return 0, self.index.lookup(root, [], owners=owners)[1]

    def _acquire(
        self, sh: SplitHistory, root: str, keys: list[str], i: int, entries: list[Entry], sampling: Sampling,
        max_tokens: int, explicit: str | None, rq: _Req, owners: frozenset[str], new_meta: dict[str, str],
        cancelled: Callable[[], bool],
    ) -> tuple[Conversation, bool, str | None, Sequence[Message]]:
        """The conversation to continue, positioned at the matched boundary, in a context this request
        now holds; whether it is new; the conversation it was forked from; the messages still to append."""
        resident = {s.conv.id for s in self._slots if s.conv is not None}
        # A warm one first (a cold one rebuilds its whole context); then its end (no fork); else the
        # conversation that goes least beyond the boundary (a regenerate of its last reply finds the logits
        # saved there); a resident one saves a restore.
        cands = sorted(entries, key=lambda e: (not self._warm(e.conv), e.rest, e.conv not in resident, -e.updated))
        want = keys[i - 1] if i > 0 else root
        for e in cands:
            if not e.end:
                break
            try:
                conv = self._open(e.conv, sampling, max_tokens, rq, cancelled)
            except LockedError:
                if explicit is not None:
                    raise
                continue  # another request or process is on it: fork below instead
            if self._at(conv, root, want):
                return conv, False, None, sh.turns[i:]
            self._release(conv, rq)  # changed on disk since it was indexed
            self._give_back(rq)
        if i > 0 and cands:
            e = cands[0]
            self._await_finishing(e.conv)  # its last reply's state is being written: fork what it holds
            parent = self.store.dir(e.conv)
            holder = next((s for s in self._slots if s.conv is not None and s.conv.id == e.conv and not s.busy), None)
            # A resident parent's cells are in its context already: the fork only cuts them back.
            in_engine = holder is not None and _stamp(parent)[:KV_STAMP] == holder.stamp[:KV_STAMP]
            try:
                # Nothing evaluated, the parent only read; shifted-out messages are carried along.
                child, _ = fork_after(self.store, parent, e.k, new_meta)
            except ConversationError as exc:
                if exc.kind != "conflict":
                    raise
                # The parent no longer has the boundary: its transcript changed since it was indexed.
                raise ServiceError("conflict", f"{exc}: it changed since it was indexed, retry") from None
            adopted = None
            if holder is not None and in_engine:
                self._take(holder, rq)
                holder.conv = None
                adopted = self.session.adopt(holder.engine, child, sampling=sampling, max_tokens=max_tokens)
                if adopted is None:
                    self._give_back(rq)
            conv = adopted or self._open(child, sampling, max_tokens, rq, cancelled)
            rq.how = "fork"
            if not self._at(conv, root, want):
                self._abandon(conv, rq, remove=True)
                raise ServiceError("conflict", f"conversation {e.conv} changed while it was being forked: retry")
            return conv, True, e.conv, sh.turns[i:]
        # Nothing stored shares more than the persona: a new conversation from the (cached) prefix. It is
        # not a fork of whichever conversation shares that persona (nothing of theirs is copied).
        info = self.index.persona_for_root(root, owners) if i == 0 else None
        if info is not None and info.hash:
            name, phash = info.name, info.hash  # a REPL persona: its prefix cache entry is reused
        else:
            name, phash = API_PERSONA, history.persona_hash(sh.persona)
        self._check_persona_fits(sh)
        slot, keep = self._free_slot()
        self._take(slot, rq)
        rq.how = "new"
        # Where the context held another conversation, what this one starts with the same (the persona, and
        # often the start of its first message) is taken up from its cells, as llama-server reuses a slot.
        conv = _drain(self.session.new_conversation_from(
            sh.persona, persona_name=name, persona_hash=phash, seed=secrets.randbits(31), sampling=sampling,
            max_tokens=max_tokens, meta=new_meta, backend=slot.engine, keep=keep))
        return conv, True, None, sh.turns

    def _open(self, cid: str, sampling: Sampling, max_tokens: int, rq: _Req,
              cancelled: Callable[[], bool] = lambda: False) -> Conversation:
        """Restore ``cid`` into a context this request takes (its own context when it is resident there)."""
        self._await_finishing(cid)
        self._await_free()
        for slot in self._slots:
            if slot.conv is not None and slot.conv.id == cid:
                if slot.busy:
                    raise LockedError(f"conversation {cid} is in use by another request")
                slot.conv.lock()
                self._take(slot, rq)
                now = _stamp(self.store.dir(cid))
                if now[:KV_STAMP] == slot.stamp[:KV_STAMP]:
                    if now != slot.stamp:
                        slot.conv.reload_meta()  # only the metadata changed (a title set in the REPL)
                    rq.how = "memory"
                    return slot.conv  # its KV is what this context holds: nothing to restore
                slot.conv.unlock()  # someone else wrote it since: restore from disk
                slot.conv = None
                break
        else:
            slot = self._take(self._free_slot()[0], rq)
        rq.how = "disk"
        try:
            # Restoring (a cold conversation rebuilds its whole context) runs without the service's lock:
            # this request holds its context (busy) and, once opened, the conversation's lock, so other
            # requests go on with other conversations meanwhile. A client that leaves stops the rebuild.
            with self._unlocked():
                return _drain(self.session.open_conversation(cid, backend=slot.engine, sampling=sampling,
                                                             max_tokens=max_tokens), cancelled)
        except BaseException:
            slot.conv = None  # what its context holds is unknown (a restore cut short)
            self._give_back(rq)
            raise

    @contextlib.contextmanager
    def _unlocked(self) -> Iterator[None]:
        """Let go of the service's lock (held once, by ``_prepare``) for a long step, then take it back."""
        self._cond.release()
        try:
            yield
        finally:
            self._cond.acquire()

    def _await_finishing(self, cid: str) -> None:
        """Wait (the service's lock let go meanwhile) while ``cid``'s last request writes its state: a request
        sent right after ``[DONE]`` continues that conversation as it was recorded."""
        self._cond.wait_for(lambda: not any(s.finishing and s.conv is not None and s.conv.id == cid
                                            for s in self._slots))

    def _await_free(self) -> None:
        """Wait (the service's lock let go meanwhile) until a context is free: ``complete`` lets a request
        in while the only free ones are still finishing."""
        self._cond.wait_for(lambda: not all(s.busy for s in self._slots))

    def _free_slot(self) -> tuple[_Slot, bool]:
        """A free context (waited for): an empty one, else the least recently used (its conversation is on
        disk already); and whether a new conversation may take up its cells (``Backend.forget``): they are
        those of the conversation it held, none of them moved by a context shift."""
        self._await_free()
        slot = min((s for s in self._slots if not s.busy), key=lambda s: (s.conv is not None, s.used))
        keep = slot.conv is not None and not slot.conv.out_of_context
        slot.conv = None
        return slot, keep

    def _take(self, slot: _Slot, rq: _Req) -> _Slot:
        slot.busy = True
        rq.slot = slot
        rq.ev0 = slot.engine.n_evaluated_total
        return slot

    def _give_back(self, rq: _Req) -> None:
        if rq.slot is not None:
            rq.slot.busy = rq.slot.finishing = False
            rq.slot = None
            self._cond.notify_all()

    def _at(self, conv: Conversation, root: str, want: str) -> bool:
        """The conversation ends exactly at the boundary the request matched."""
        keys = conversation_keys(root, conv)
        return bool(keys) and keys[-1][0] == want and keys[-1][1] == len(conv.messages)

    def _release(self, conv: Conversation, rq: _Req, *, indexed: bool = False) -> None:
        """The request is done with the conversation: what it kept back is written (without the service's
        lock: other requests go on), then it stays resident in its context, unlocked. ``indexed``: the
        index has it already."""
        ok = False
        try:
            conv.commit()
            ok = True
        finally:
            self._settle(conv, rq, indexed, resident=ok)

    def _settle(self, conv: Conversation, rq: _Req, indexed: bool, *, resident: bool = True) -> None:
        with self._cond:
            try:
                if not indexed:
                    self.index.update(conv)
                if rq.slot is not None:
                    # A commit that failed (the closing could not be decoded) leaves a context that does not
                    # hold what the transcript says: restored next time.
                    rq.slot.conv = conv if resident else None
                    rq.slot.stamp = _stamp(self.store.dir(conv.id))
                    rq.slot.used = time.monotonic()
            finally:
                conv.unlock()
            self.index.save_soon()

    def _gone(self, conv: Conversation, rq: _Req, prep: _Prepared) -> None:
        """The client left before its reply started: keep what was appended, drop a conversation this
        request created that holds nothing yet."""
        if prep.created and not conv.messages:
            self._abandon(conv, rq, remove=True)
        else:
            self._release(conv, rq)

    def _abandon(self, conv: Conversation, rq: _Req, *, remove: bool) -> None:
        """A request that failed: the conversation is released, and removed when this request made it."""
        with self._cond:
            if rq.slot is not None:
                rq.slot.conv = None
            conv.unlock()
            if remove:
                try:
                    self.store.remove(self.store.dir(conv.id))
                except (OSError, StoreError):
                    pass
            self.index.refresh()

    def close(self, timeout: float = 30.0) -> None:
        """Stop: running replies are cut (recorded like Ctrl-C) and waited for, then the contexts freed."""
        with self._cond:
            for s in self._slots:
                if s.busy:
                    s.engine.cancel()
            self._cond.wait_for(lambda: not any(s.busy for s in self._slots), timeout)
            for s in self._slots:
                if s.conv is not None and not s.busy:
                    self._close_reply(s, s.conv)
            self.index.save()
            for s in self._slots:
                s.conv = None
            for s in self._slots[1:]:
                s.engine.close()  # siblings first: the first context's engine owns the model


    def _close_reply(self, slot: _Slot, conv: Conversation) -> None:
        """A resident conversation's last reply's closing, decoded and saved at shutdown (it waits for the next
        prompt otherwise): unless another process took the conversation or wrote it since."""
        try:
            conv.lock()
        except (LockedError, StoreError, OSError):
            return
        try:
            if _stamp(self.store.dir(conv.id))[:KV_STAMP] == slot.stamp[:KV_STAMP]:
                conv.close_reply()
        except (BackendError, OSError):
            pass  # the state file only lags behind the transcript: a resume evaluates the closing
        finally:
            conv.unlock()


def _drain(opening: Opening[Conversation], cancelled: Callable[[], bool] | None = None) -> Conversation:
    """Run an opening to its end (the session gave its conversation the state budget hook). ``cancelled``
    is asked between evaluated batches of a rebuild: True closes the opening (releasing the conversation's
    lock; the state file is rewritten only once a rebuild completes, so it is left as it was) and raises
    ``OpenCancelled``."""
    if drain(opening, stop=cancelled).stopped:
        raise OpenCancelled("the client went away")
    return opening.conversation


def _stamp(conv_dir: ConversationDir) -> tuple[int, ...]:
    """What changes when anyone writes the conversation: its transcript and state file (a resident copy's
    KV is valid while those are unchanged: the first ``KV_STAMP`` entries), then its metadata (to be
    re-read when it changed)."""
    out = []
    for p in (conv_dir.transcript_path, conv_dir.state_path, conv_dir.meta_path):
        try:
            st = Path(p).stat()
            out += [st.st_size, st.st_mtime_ns]
        except OSError:
            out += [-1, -1]
    return tuple(out)


def _close(it: Iterator[object]) -> None:
    """Close a generator: a reply being generated is then recorded as it stands (like Ctrl-C)."""
    close = getattr(it, "close", None)
    if close is not None:
        close()


def _safe_prefix(text: str, stops: Sequence[str]) -> str:
    """The part of a reply being streamed that can be sent already: never a piece of a stop string nor
    trailing whitespace, which the final text may cut; so what a client receives is a prefix of what is
    stored, and resending it matches the conversation."""
    cut = len(text)
    for s in stops:
        cut = min(cut, len(text) - stop_prefix_at_end(text, s, len(s)))
    return text[:cut].rstrip()
