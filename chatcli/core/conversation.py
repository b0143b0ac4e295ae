"""A conversation: turns, alternatives, rollback points, context shifts and their persistence.

It drives the engine (what the context holds) and the store (what is on disk) and keeps them equal:

- the transcript (JSON Lines, fsynced) is written first and is the truth;
- the state file gets, per turn, only the cells that turn added (plus the logits after the user message,
  so that /regen samples again without evaluating anything);
- rolling back is ``engine.truncate`` plus a small TRUNCATE record.

Operations are generators of events (``Notice``, ``Progress``, ``ReplyStart``, ``ReplyText``,
``ReplyEnd``) that the REPL renders; nothing here prints.
"""

from __future__ import annotations

import codecs
import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from chatcli.core import budget, prefixcache, rebuild
from chatcli.core import statefile as sf
from chatcli.backends.llamacpp import ContextFullError, Engine, GenerationResult, Sampling
from chatcli.core.store import ConversationDir, ConversationStore
from chatcli.core.template import ChatTemplate, Message

class ConversationError(ValueError):
    """A request the conversation cannot honour (one line for the user); nothing was changed."""


# -- events ------------------------------------------------------------------------------------------


@dataclass
class Notice:
    text: str
    level: str = "info"  # info | warn | error


@dataclass
class Progress:
    label: str
    done: int
    total: int
    seconds: float = 0.0


@dataclass
class ReplyStart:
    turn: int
    alt: int


@dataclass
class ReplyText:
    text: str


@dataclass
class TurnStats:
    n_eval: int = 0  # tokens evaluated for this turn (new user tokens + decoded reply tokens + closing)
    n_prompt: int = 0
    prompt_seconds: float = 0.0
    ttft: float = 0.0
    n_generated: int = 0
    gen_seconds: float = 0.0
    stop_reason: str = ""
    n_past: int = 0
    n_ctx: int = 0
    state_bytes: int = 0
    save_ms: float = 0.0
    kept: int | None = None  # rollbacks: tokens kept / dropped / re-evaluated
    dropped: int | None = None
    reevaluated: int | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.n_generated / self.gen_seconds if self.gen_seconds > 0 else 0.0


@dataclass
class ReplyEnd:
    message: ActiveMessage
    stats: TurnStats


Event = Notice | Progress | ReplyStart | ReplyText | ReplyEnd


# -- transcript model ----------------------------------------------------------------------------------


@dataclass
class ActiveMessage:
    """A message in the context: its text, the exact tokens it contributed and where they sit."""

    mid: int
    role: str
    text: str
    tokens: list[int]
    p0: int
    turn: int
    alt: int = 0
    stop: str = ""
    ts: float = 0.0

    @property
    def p1(self) -> int:
        return self.p0 + len(self.tokens)

    def as_message(self) -> Message:
        return Message(self.role, self.text)


@dataclass
class Replay:
    """The transcript's events folded into the current state of the conversation."""

    prefix_tokens: list[int] = field(default_factory=list)
    persona: str = ""
    persona_messages: list[Message] = field(default_factory=list)
    active: list[ActiveMessage] = field(default_factory=list)
    all: dict[int, dict[str, Any]] = field(default_factory=dict)
    out_of_context: list[int] = field(default_factory=list)  # message ids dropped by context shifts
    redo: list[list[int]] = field(default_factory=list)
    undone: set[int] = field(default_factory=set)
    next_mid: int = 0
    max_turn: int = -1  # turn ids are never reused: after /undo or a shift a new turn gets a new id
    has_prefix: bool = False
    problems: list[str] = field(default_factory=list)

    def tokens(self) -> list[int]:
        out = list(self.prefix_tokens)
        for m in self.active:
            out.extend(m.tokens)
        return out

    def apply(self, ev: dict[str, Any]) -> None:
        kind = ev.get("type")
        if kind == "prefix":
            self.prefix_tokens = [int(t) for t in ev["tokens"]]
            self.persona = str(ev.get("persona", ""))
            self.persona_messages = [Message(m["role"], m["content"]) for m in ev.get("messages", [])]
            self.has_prefix = True
        elif kind == "message":
            mid = int(ev["mid"])
            self.all[mid] = ev
            self.next_mid = max(self.next_mid, mid + 1)
            self.max_turn = max(self.max_turn, int(ev.get("turn", 0)))
            self._push(ev, int(ev["span"][0]))
            self.redo.clear()
        elif kind == "activate":
            ev_msg = self.all.get(int(ev["mid"]))
            if ev_msg is not None:
                self._push(ev_msg, int(ev["p0"]))
                self.undone.discard(int(ev["mid"]))
            if ev.get("redo") and self.redo:
                self.redo.pop()
        elif kind == "truncate":
            to = int(ev["to"])
            removed = [m for m in self.active if m.p0 >= to]
            self.active = [m for m in self.active if m.p0 < to]
            if ev.get("reason") == "undo" and removed:
                self.redo.append([m.mid for m in removed])
                self.undone.update(m.mid for m in removed)
            elif ev.get("reason") != "redo":
                self.redo.clear()
        elif kind == "shift":
            keep, drop = int(ev["keep"]), int(ev["drop"])
            kept: list[ActiveMessage] = []
            for m in self.active:
                if keep <= m.p0 < keep + drop:
                    self.out_of_context.append(m.mid)
                else:
                    if m.p0 >= keep + drop:
                        m.p0 -= drop
                    kept.append(m)
            self.active = kept
        # unknown event types from newer versions are skipped: the transcript stays readable

    def _push(self, ev: dict[str, Any], p0: int) -> None:
        expected = len(self.prefix_tokens) + sum(len(m.tokens) for m in self.active)
        if p0 != expected:
            self.problems.append(f"message {ev.get('mid')} starts at {p0}, expected {expected}; skipped")
            return
        self.active.append(ActiveMessage(
            mid=int(ev["mid"]), role=str(ev["role"]), text=str(ev.get("text", "")),
            tokens=[int(t) for t in ev["tokens"]], p0=p0, turn=int(ev.get("turn", 0)),
            alt=int(ev.get("alt", 0)), stop=str(ev.get("stop", "")), ts=float(ev.get("ts", 0.0)),
        ))

    def alternatives(self, turn: int) -> list[dict[str, Any]]:
        return [e for e in self.all.values() if e["role"] == "assistant" and int(e.get("turn", -1)) == turn]


def replay_events(events: Sequence[dict[str, Any]]) -> Replay:
    r = Replay()
    for ev in events:
        try:
            r.apply(ev)
        except (KeyError, TypeError, ValueError) as exc:
            r.problems.append(f"transcript event {ev.get('type')!r} is malformed ({exc}); skipped")
    return r


def reply_seed(conv_seed: int, turn: int, alt: int) -> int:
    """The sampler seed of one reply: same conversation, turn and alternative ⇒ same reply, any process."""
    h = hashlib.sha256(f"{conv_seed}:{turn}:{alt}".encode()).digest()
    return int.from_bytes(h[:4], "little")


@dataclass
class ResumeReport:
    restored_tokens: int = 0
    restored_bytes: int = 0
    seconds: float = 0.0
    reevaluated: int = 0
    reason: str = ""  # why the saved state was not (fully) used


# -- the conversation ------------------------------------------------------------------------------


class Conversation:
    """One open conversation bound to the process's engine. Holds the conversation's lock."""

    def __init__(
        self,
        engine: Engine,
        template: ChatTemplate,
        conv: ConversationDir,
        meta: dict[str, Any],
        replay: Replay,
        sampling: Sampling,
        *,
        identity: dict[str, Any],
        max_tokens: int = 1024,
        reserve: int = 256,
    ) -> None:
        self.engine = engine
        self.template = template
        self.dir = conv
        self.meta = meta
        self.r = replay
        self.sampling = sampling
        self.identity = identity
        self.max_tokens = max_tokens
        self.reserve = reserve
        self.state = sf.ScanResult(header=None)
        self.writer = sf.StateWriter(conv.state_path)
        self.turn_logits: tuple[int, np.ndarray] | None = None
        self.last_stats: TurnStats | None = None
        self.session_stats: dict[str, float] = {"turns": 0, "n_eval": 0, "n_generated": 0, "gen_seconds": 0.0}
        self._stop_strings = template.reply_stop_strings()
        self._warned_no_shift = False
        self.save_error: str = ""
        # Set by the Session: called after every successful state write (the state budget); returns a line
        # to show, or None. Its notices are yielded before the next ReplyEnd, or taken by the front end.
        self.after_save: Callable[[], str | None] | None = None
        self._pending_notices: list[Notice] = []

    # -- construction ------------------------------------------------------------------------------

    @property
    def id(self) -> str:
        return self.dir.id

    @property
    def seed(self) -> int:
        return int(self.meta["seed"])

    @property
    def title(self) -> str:
        return str(self.meta.get("title") or "")

    @classmethod
    def create(
        cls,
        store: ConversationStore,
        engine: Engine,
        template: ChatTemplate,
        *,
        persona_name: str,
        persona_messages: list[Message],
        persona_hash: str,
        identity: dict[str, Any],
        model_path: str,
        sampling: Sampling,
        seed: int,
        prefix_cache_dir: Path | None = None,
        max_tokens: int = 1024,
        reserve: int = 256,
    ) -> Iterator[Event | Conversation]:
        """Start a conversation from a persona; yields progress, then the Conversation itself."""
        meta = {
            "title": "", "persona": persona_name, "persona_hash": persona_hash, "model": {"path": model_path, **identity},
            "params": {"n_ctx": engine.n_ctx, **engine.kv_params}, "seed": seed, "turns": 0, "tokens": 0,
        }
        conv = store.create(meta)
        conv.lock()
        meta = conv.read_meta()
        prefix_text = template.prefix(persona_messages)
        add_special = engine.add_bos and not (template.bos_token and prefix_text.startswith(template.bos_token))
        prefix_tokens = engine.tokenize(prefix_text, add_special=add_special) if prefix_text else (
            [engine.bos_token] if engine.add_bos else [])
        conv.append_event({
            "type": "prefix", "persona": persona_name, "persona_hash": persona_hash,
            "messages": [m.as_dict() for m in persona_messages], "tokens": prefix_tokens, "span": [0, len(prefix_tokens)],
        })
        replay = replay_events(conv.read_transcript().events)
        self = cls(engine, template, conv, meta, replay, sampling, identity=identity,
                   max_tokens=max_tokens, reserve=reserve)
        engine.clear()
        yield from self._load_prefix(prefix_tokens, prefix_cache_dir)
        yield self

    def _state_header(self) -> bytes:
        return sf.encode_record(sf.HEADER, 0, 0, sf.header_payload(self.state_identity()))

    def state_identity(self) -> dict[str, Any]:
        return prefixcache.state_identity(self.identity, self.engine.n_ctx, self.engine.kv_params)

    def _load_prefix(self, prefix_tokens: list[int], cache_dir: Path | None) -> Iterator[Event]:
        cache_file = None
        if cache_dir is not None:
            cache_file = prefixcache.cache_path(
                cache_dir, self.state_identity(), str(self.meta.get("persona_hash", "")), self.template.source)
        records, _hit = yield from prefixcache.load_or_build(self.engine, prefix_tokens, cache_file, self.state_identity())
        # The conversation gets its own copy of the prefix cells: it keeps working if the cache is cleared.
        self.writer.rewrite(records)
        self.state = sf.scan(self.dir.state_path)

    @classmethod
    def open(
        cls,
        store: ConversationStore,
        ref: str | None,
        engine: Engine,
        template: ChatTemplate,
        *,
        identity: dict[str, Any],
        sampling: Sampling,
        max_tokens: int = 1024,
        reserve: int = 256,
        lock: bool = True,
        persona_messages: list[Message] | None = None,
    ) -> Iterator[Event | ResumeReport | Conversation]:
        """Resume a conversation: restore its KV from the state file, evaluating only what is missing."""
        conv = store.resolve(ref)
        if lock:
            conv.lock()
        meta = conv.read_meta()
        tr = conv.read_transcript()
        conv.repair_transcript_tail()
        for p in tr.problems:
            yield Notice(p, "warn")
        replay = replay_events(tr.events)
        for p in replay.problems:
            yield Notice(p, "warn")
        if not replay.has_prefix:
            if replay.all or persona_messages is None:
                raise ConversationError(f"conversation {conv.id}: its transcript lost the persona prefix record")
            # Killed before the first transcript line was written: start the prefix now from the persona.
            text = template.prefix(persona_messages)
            toks = engine.tokenize(text, add_special=engine.add_bos) if text else []
            ev = {"type": "prefix", "persona": meta.get("persona", ""), "persona_hash": meta.get("persona_hash", ""),
                  "messages": [m.as_dict() for m in persona_messages], "tokens": toks, "span": [0, len(toks)]}
            conv.append_event(ev)
            replay.apply(ev)
            yield Notice("the conversation had no transcript yet: started it from its persona", "warn")
        self = cls(engine, template, conv, meta, replay, sampling, identity=identity,
                   max_tokens=max_tokens, reserve=reserve)
        report = ResumeReport()
        yield from self._restore(report)
        yield report
        yield self

    def _restore(self, report: ResumeReport) -> Iterator[Event]:
        eng = self.engine
        eng.clear()
        for i, m in enumerate(self.r.active):
            if any(not 0 <= t < eng.n_vocab for t in m.tokens):
                # A damaged message cannot be evaluated: keep everything before it, say what was dropped.
                dropped = self.r.active[i:]
                self.r.active = self.r.active[:i]
                yield Notice(f"transcript message {m.mid} holds invalid token ids: it and {len(dropped) - 1} "
                             "later message(s) were left out of the context", "warn")
                break
        want = self.r.tokens()
        if len(want) + 1 > eng.n_ctx:
            raise ConversationError(
                f"conversation holds {len(want)} tokens but the context is {eng.n_ctx}: resume with --n-ctx {len(want) + self.reserve}")
        t0 = time.perf_counter()
        res = sf.scan(self.dir.state_path)
        loaded_bytes = 0
        logits_rec: sf.Record | None = None
        usable = res.header is not None and res.header.get("identity") == self.state_identity()
        if res.header is None:
            report.reason = "no saved state" if res.problem in ("missing", "empty") else f"state file unusable ({res.problem})"
            if res.problem == "missing" and budget.was_evicted(self.meta):
                report.reason = "its KV state was dropped to keep within the state budget"
        elif not usable:
            report.reason = prefixcache.identity_mismatch(res.header.get("identity"), self.state_identity())
        else:
            if res.dropped_bytes:
                report.reason = f"dropped {res.dropped_bytes} bytes of a damaged state record ({res.problem})"
            chunks, logits_rec, _ = res.live()
            for ch in chunks:
                rec = ch.record
                try:
                    payload = sf.read_payload(self.dir.state_path, rec)
                except sf.StateFileError as exc:
                    report.reason = f"state record unreadable ({exc})"
                    break
                toks, kv = sf.split_cells(payload, rec.p1 - rec.p0)
                if want[rec.p0:ch.end] != toks[: ch.end - rec.p0]:
                    report.reason = "saved state does not match the transcript"
                    break
                try:
                    eng.load_cells(rec.p0, rec.p1, kv, toks)
                except Exception as exc:  # llama.cpp rejected it: rebuild from tokens instead
                    report.reason = f"saved cells rejected ({exc})"
                    break
                if ch.end < rec.p1:
                    eng.truncate(ch.end)
                loaded_bytes += rec.size
        report.restored_tokens = eng.n_past
        report.restored_bytes = loaded_bytes
        report.seconds = time.perf_counter() - t0
        n_ok = eng.n_past
        if logits_rec is not None and logits_rec.p0 <= n_ok:
            try:
                arr = np.frombuffer(sf.read_payload(self.dir.state_path, logits_rec), dtype="<f4")
                if arr.shape == (eng.n_vocab,):
                    self.turn_logits = (logits_rec.p0, arr.copy())
            except sf.StateFileError:
                pass
        # Catch up: evaluate only the tail the state file did not have.
        tail = want[n_ok:]
        if tail:
            t1 = time.perf_counter()
            # Batched as the tokens were when first evaluated, so the rebuilt KV is bit-identical (rebuild.py).
            plan = rebuild.segments(len(self.r.prefix_tokens), self.r.active, self._closing_len)
            for done, total in rebuild.evaluate(eng, want, n_ok, plan):
                yield Progress("rebuilding context from the transcript", done, total, time.perf_counter() - t1)
            report.reevaluated = len(tail)
        # Bring the state file in line with the context (one rewrite; the common case writes nothing).
        if not usable or res.dropped_bytes or n_ok < res.live()[2] or tail:
            self._rewrite_state()
        else:
            self.state = res
        self._remember_state_params()
        if self.turn_logits and self.turn_logits[0] == eng.n_past:
            eng.set_logits(self.turn_logits[1])

    def _remember_state_params(self) -> None:
        """The metadata says which KV format the state file holds (resuming with another --kv-type changes
        it) and forgets an eviction once the state is back."""
        params = {"n_ctx": self.engine.n_ctx, **self.engine.kv_params}
        if self.meta.get("params") == params and "evicted" not in self.meta:
            return
        self.meta["params"] = params
        self.meta.pop("evicted", None)
        try:
            self.dir.write_meta(self.meta)
        except OSError as exc:
            self.save_error = f"could not update metadata ({exc.strerror or exc})"

    # -- views -----------------------------------------------------------------------------------------

    @property
    def messages(self) -> list[ActiveMessage]:
        return list(self.r.active)

    def history(self) -> list[Message]:
        return [*self.r.persona_messages, *(m.as_message() for m in self.r.active)]

    @property
    def n_turns(self) -> int:
        return sum(1 for m in self.r.active if m.role == "user")

    @property
    def pending_user(self) -> bool:
        """The last message is a user message without a reply (the process died mid-reply)."""
        return bool(self.r.active) and self.r.active[-1].role == "user"

    def state_bytes(self) -> int:
        return self.dir.state_size()

    # -- sending -----------------------------------------------------------------------------------

    def send(self, text: str, *, seed: int | None = None) -> Iterator[Event]:
        """Add a user message and stream the reply."""
        self.engine.reset_cancel()
        if self.pending_user:
            raise ConversationError("the last message has no reply yet: /regen to generate it")
        if not text.strip():
            raise ConversationError("empty message")
        stats = TurnStats()
        glue = self.template.user_turn(self.history(), text)
        tokens = self.engine.tokenize(glue, add_special=False)
        yield from self._make_room(len(tokens), stats)
        turn = self.r.max_turn + 1
        p0 = self.engine.n_past
        # Transcript first: whatever happens next, the user's words are on disk.
        mid = self._write_message("user", text, tokens, p0, turn)
        t0 = time.perf_counter()
        for done, total in self.engine.eval_steps(tokens):
            if total > self.engine.n_batch:  # a bar only for messages that take more than one batch
                yield Progress("reading your message", done, total, time.perf_counter() - t0)
        stats.prompt_seconds = time.perf_counter() - t0
        stats.n_prompt = len(tokens)
        self._after_user_eval(p0, tokens, stats)
        self.r.active.append(ActiveMessage(mid, "user", text, tokens, p0, turn))
        if not self.title:
            self.meta["title"] = _make_title(text)
        yield from self._reply(turn, alt=0, stats=stats, seed=seed)

    def _after_user_eval(self, p0: int, tokens: list[int], stats: TurnStats) -> None:
        logits = self.engine.logits()
        self.turn_logits = (self.engine.n_past, logits)
        if self._needs_snapshot:
            # After a context shift the moved K cells were rotated by this decode: only now is a snapshot
            # valid. Reloading it also lays the cells out exactly as a resumed process will have them, so
            # this process and a resumed one continue bit-identically.
            data = self._rewrite_state()
            if data is not None:
                toks = list(self.engine.tokens)
                self.engine.clear()
                self.engine.load_cells(0, len(toks), data, toks)
                self.engine.set_logits(logits)
            self._needs_snapshot = False
            return
        kv = self.engine.save_cells(p0, p0 + len(tokens))
        recs = [sf.encode_record(sf.CELLS, p0, p0 + len(tokens), sf.cells_payload(tokens, kv))]
        recs.append(sf.encode_record(sf.LOGITS, self.engine.n_past, self.engine.n_past, logits.astype("<f4").tobytes()))
        stats.state_bytes += self._append(recs, stats)

    _needs_snapshot = False

    def _reply(self, turn: int, *, alt: int, stats: TurnStats, seed: int | None) -> Iterator[Event]:
        eng = self.engine
        if self.turn_logits and self.turn_logits[0] == eng.n_past and not eng.has_logits:
            eng.set_logits(self.turn_logits[1])
        stats.reevaluated = (stats.reevaluated or 0) + eng.ensure_logits()
        # No --seed: each alternative gets its own seed (a new reply every /regen). An explicit --seed makes
        # the reply reproducible: the same seed gives the same reply whichever alternative it becomes.
        use_seed = reply_seed(self.seed, turn, alt) if seed is None else reply_seed(seed, turn, 0)
        p0 = eng.n_past
        res = GenerationResult()
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        text = ""
        gen = eng.generate(self.sampling, seed=use_seed, max_tokens=self.max_tokens, result=res,
                           stop_strings=self._stop_strings, reserve=0)
        # If our consumer stops listening (closes us, or dies with an error), the reply produced so far is
        # still recorded like a Ctrl-C'd one: the context and the transcript must never disagree.
        abandoned = False
        try:
            yield ReplyStart(turn, alt)
            for ev in gen:
                piece = decoder.decode(ev.piece)
                if piece:
                    text += piece
                    shown = _cut_stop(text, self._stop_strings)
                    if shown is not None:
                        break
                    yield ReplyText(piece)
        except GeneratorExit:
            abandoned = True
        finally:
            gen.close()
        if abandoned and res.stop_reason in ("", "eog", "stop", "length"):
            res.stop_reason = res.stop_reason or "cancelled"
        text += decoder.decode(b"", final=True)
        cut = _cut_stop(text, self._stop_strings)
        if cut is not None:
            text = cut
        reply_tokens = eng.tokens[p0:]
        # Close the reply now (e.g. the "\n" after <|im_end|>) so every message holds its whole rendering:
        # then whole exchanges can be dropped by a context shift without leaving half a turn behind.
        closing = self._closing_tokens(text, reply_tokens, res.stop_reason)
        if closing and eng.n_past + len(closing) <= eng.n_ctx:
            eng.eval(closing)
            reply_tokens = eng.tokens[p0:]
        # Time to first token as the user feels it: reading their message plus sampling the first token.
        stats.ttft = stats.prompt_seconds + res.ttft
        stats.n_generated = len(res.tokens)
        stats.gen_seconds = res.seconds
        stats.stop_reason = res.stop_reason
        stats.n_eval += stats.n_prompt + len(reply_tokens)
        try:
            mid = self._write_message("assistant", text, reply_tokens, p0, turn, alt=alt, stop=res.stop_reason)
        except OSError:
            # Not in the transcript means not in the conversation: the context must not keep it either.
            eng.truncate(p0)
            if self.turn_logits and self.turn_logits[0] == p0:
                eng.set_logits(self.turn_logits[1])
            raise
        msg = ActiveMessage(mid, "assistant", text, reply_tokens, p0, turn, alt, res.stop_reason)
        self.r.active.append(msg)
        kv = eng.save_cells(p0, eng.n_past)
        stats.state_bytes += self._append([sf.encode_record(sf.CELLS, p0, eng.n_past, sf.cells_payload(reply_tokens, kv))], stats)
        self._maybe_compact()
        self._touch_meta()
        stats.n_past = eng.n_past
        stats.n_ctx = eng.n_ctx
        self.last_stats = stats
        self.session_stats["turns"] += 1
        self.session_stats["n_eval"] += stats.n_eval
        self.session_stats["n_generated"] += stats.n_generated
        self.session_stats["gen_seconds"] += stats.gen_seconds
        if abandoned:
            return  # a closed generator must not yield again
        yield from self.take_notices()
        yield ReplyEnd(msg, stats)

    def _closing_len(self, i: int) -> int:
        """How many tokens at the end of reply ``i`` are the template's closing (evaluated as one batch)."""
        m = self.r.active[i]
        history = [*self.r.persona_messages, *(x.as_message() for x in self.r.active[:i])]
        for n in range(0, min(len(m.tokens) - 1, 16) + 1):
            if self._closing_tokens(m.text, m.tokens[:len(m.tokens) - n], m.stop, history) == m.tokens[len(m.tokens) - n:]:
                return n
        return 0  # the closing did not fit in the context (or the template changed): all decoded one by one

    def _closing_tokens(self, text: str, reply_tokens: list[int], stop: str,
                        history: list[Message] | None = None) -> list[int]:
        history = self.history() if history is None else history
        closing = self.template.closing([*history, Message("assistant", text)])
        if stop == "eog" and reply_tokens:
            eog_text = self.engine.piece(reply_tokens[-1], special=True).decode("utf-8", "replace")
            # A model may end with a token the template does not write (e.g. EOS after ChatML): then the
            # template's whole closing still follows, so the next turn reads as the template expects.
            if eog_text and closing.startswith(eog_text):
                closing = closing[len(eog_text):]
        return self.engine.tokenize(closing, add_special=False) if closing else []

    def cancel(self) -> None:
        self.engine.cancel()

    # -- rollback ---------------------------------------------------------------------------------

    def regen(self, *, seed: int | None = None) -> Iterator[Event]:
        """Sample a new reply to the last user message; the old one stays as an alternative."""
        self.engine.reset_cancel()
        if not self.r.active:
            raise ConversationError("nothing to regenerate yet")
        stats = TurnStats()
        last = self.r.active[-1]
        if last.role == "assistant":
            to = last.p0
            turn = last.turn
            user_msg = self.r.active[-2] if len(self.r.active) >= 2 else None
            if user_msg is None or user_msg.role != "user":
                raise ConversationError("the last reply is part of the persona and cannot be regenerated")
            dropped = self._truncate(to, "regen")
            stats.dropped = dropped
        else:
            turn = last.turn
            stats.dropped = 0
        stats.kept = self.engine.n_past
        alt = len(self.r.alternatives(turn))
        stats.reevaluated = 0
        yield from self._reply(turn, alt=alt, stats=stats, seed=seed)

    def _truncate(self, to: int, reason: str) -> int:
        eng = self.engine
        dropped = eng.n_past - to
        self.dir.append_event({"type": "truncate", "to": to, "reason": reason})
        self.r.apply({"type": "truncate", "to": to, "reason": reason})
        eng.truncate(to)
        self._append([sf.encode_record(sf.TRUNCATE, to, to, b"")], None)
        if self.turn_logits and self.turn_logits[0] == to:
            eng.set_logits(self.turn_logits[1])
        elif self.turn_logits and self.turn_logits[0] > to:
            self.turn_logits = None
        return dropped

    def undo(self, n: int = 1) -> TurnStats:
        """Remove the last ``n`` exchanges (kept in the transcript as undone; /redo brings them back)."""
        users = [m for m in self.r.active if m.role == "user"]
        if n < 1:
            raise ConversationError("undo needs a positive count")
        if len(users) < n:
            raise ConversationError(f"only {len(users)} exchange(s) to undo")
        to = users[-n].p0
        stats = TurnStats(kept=to, reevaluated=0)
        stats.dropped = self._truncate(to, "undo")
        self._maybe_compact()
        self._touch_meta()
        return stats

    def redo(self) -> TurnStats:
        if not self.r.redo:
            raise ConversationError("nothing to redo")
        mids = self.r.redo[-1]
        total = sum(len(self.r.all[m]["tokens"]) for m in mids)
        if self.engine.n_past + total > self.engine.n_ctx:
            raise ConversationError("the undone exchanges no longer fit in the context")
        stats = TurnStats(kept=self.engine.n_past, dropped=0)
        tokens: list[int] = []
        p0 = self.engine.n_past
        for i, mid in enumerate(mids):
            ev = {"type": "activate", "mid": mid, "p0": p0 + len(tokens), "redo": i == 0}
            self.dir.append_event(ev)
            self.r.apply(ev)
            tokens.extend(int(t) for t in self.r.all[mid]["tokens"])
        loaded = self._cells_from_file(tokens)
        stats.n_eval = len(tokens) - loaded
        stats.reevaluated = stats.n_eval
        self._touch_meta()
        return stats

    def switch_alt(self, index: int) -> TurnStats:
        """Make alternative ``index`` (0-based) of the last turn the active reply."""
        last = self.r.active[-1] if self.r.active else None
        if last is None or last.role != "assistant":
            raise ConversationError("no reply to switch")
        alts = sorted(self.r.alternatives(last.turn), key=lambda e: int(e.get("alt", 0)))
        if not 0 <= index < len(alts):
            raise ConversationError(f"no alternative {index + 1} (this turn has {len(alts)})")
        target = alts[index]
        if int(target["mid"]) == last.mid:
            return TurnStats(kept=self.engine.n_past, dropped=0, reevaluated=0)
        to = last.p0
        stats = TurnStats(kept=to)
        stats.dropped = self._truncate(to, "alt")
        ev = {"type": "activate", "mid": int(target["mid"]), "p0": to}
        self.dir.append_event(ev)
        self.r.apply(ev)
        toks = [int(t) for t in target["tokens"]]
        loaded = self._cells_from_file(toks)
        stats.reevaluated = 0
        stats.n_eval = len(toks) - loaded
        self._maybe_compact()
        self._touch_meta()
        return stats

    def _cells_from_file(self, tokens: list[int]) -> int:
        """Put ``tokens`` back after the current context, reusing cells the state file still holds.

        A rolled-back reply's CELLS record stays in the file (dead, until compaction): switching back to it
        or redoing it reads those cells instead of evaluating. Returns how many tokens came from the file;
        the rest is evaluated. Either way a record that is live again is appended.
        """
        eng = self.engine
        p0 = eng.n_past
        loaded = 0
        path = self.dir.state_path
        while loaded < len(tokens):
            pos = p0 + loaded
            rec = next((r for r in reversed(self.state.records)
                        if r.kind == sf.CELLS and r.p0 == pos and r.p1 <= p0 + len(tokens)), None)
            if rec is None:
                break
            try:
                toks, kv = sf.split_cells(sf.read_payload(path, rec), rec.p1 - rec.p0)
                if toks != tokens[loaded:loaded + len(toks)]:
                    break
                eng.load_cells(rec.p0, rec.p1, kv, toks)
            except Exception:
                break
            loaded += len(toks)
        if loaded < len(tokens):
            eng.eval(tokens[loaded:])
        kv = eng.save_cells(p0, eng.n_past)
        self._append([sf.encode_record(sf.CELLS, p0, eng.n_past, sf.cells_payload(tokens, kv))], None)
        return loaded

    def user_messages(self) -> list[ActiveMessage]:
        return [m for m in self.r.active if m.role == "user"]

    def edit(self, n: int | None, text: str, *, seed: int | None = None) -> Iterator[Event]:
        """Replace user message ``n`` (1-based; default the last) and continue from it."""
        users = self.user_messages()
        if not users:
            raise ConversationError("no message to edit")
        idx = len(users) if n is None else n
        if not 1 <= idx <= len(users):
            raise ConversationError(f"no message {idx} (there are {len(users)})")
        if not text.strip():
            raise ConversationError("empty message")
        target = users[idx - 1]
        self._truncate(target.p0, "edit")
        yield from self.send(text, seed=seed)

    def set_title(self, title: str) -> None:
        self.meta["title"] = title.strip()[:120]
        self._touch_meta()

    # -- context shift ------------------------------------------------------------------------------

    def _make_room(self, n_new: int, stats: TurnStats) -> Iterator[Event]:
        eng = self.engine
        need = eng.n_past + n_new + self.reserve
        if need <= eng.n_ctx:
            return
        keep = len(self.r.prefix_tokens)
        budget = eng.n_ctx - self.reserve - n_new
        if keep + n_new + 1 > eng.n_ctx or budget < keep:
            raise ContextFullError(
                f"message too long: {n_new} tokens, at most {max(0, eng.n_ctx - keep - self.reserve)} fit "
                f"(n_ctx {eng.n_ctx}, persona {keep}, reserve {self.reserve})")
        # Drop the oldest whole exchanges until what is left fits.
        drop = 0
        i = 0
        active = self.r.active
        while eng.n_past - drop > budget and i < len(active):
            drop += len(active[i].tokens)
            i += 1
            while i < len(active) and active[i].role != "user":
                drop += len(active[i].tokens)
                i += 1
        if eng.n_past - drop > budget:
            raise ContextFullError("message does not fit even after dropping all earlier turns")
        n_msgs = i
        ev = {"type": "shift", "keep": keep, "drop": drop}
        self.dir.append_event(ev)
        self.r.apply(ev)
        if eng.can_shift:
            eng.shift(keep, drop)
            yield Notice(f"context full: {n_msgs} oldest message(s) ({drop} tokens) left the context; "
                         f"kept the persona and {eng.n_past - keep} tokens, nothing re-evaluated", "info")
        else:
            kept = eng.tokens[keep + drop:]
            eng.truncate(keep)
            if not self._warned_no_shift:
                yield Notice("this model's memory cannot be shifted: rebuilding the kept context instead", "warn")
                self._warned_no_shift = True
            t0 = time.perf_counter()
            for done, total in eng.eval_steps(kept):
                yield Progress("rebuilding context", done, total, time.perf_counter() - t0)
            stats.reevaluated = (stats.reevaluated or 0) + len(kept)
        self.turn_logits = None
        self._needs_snapshot = True

    # -- persistence ---------------------------------------------------------------------------------

    def _write_message(self, role: str, text: str, tokens: list[int], p0: int, turn: int, *, alt: int = 0, stop: str = "") -> int:
        mid = self.r.next_mid
        self.r.next_mid += 1
        ev = {"type": "message", "mid": mid, "role": role, "text": text, "tokens": tokens,
              "span": [p0, p0 + len(tokens)], "turn": turn, "alt": alt}
        if stop:
            ev["stop"] = stop
        self.dir.append_event(ev)
        self.r.all[mid] = {**ev}
        self.r.max_turn = max(self.r.max_turn, turn)
        self.r.redo.clear()
        return mid

    def _append(self, records: list[bytes], stats: TurnStats | None) -> int:
        t0 = time.perf_counter()
        try:
            if self.state.header is None:
                self._rewrite_state()
                return 0
            if self.state.dropped_bytes:
                self.writer.cut(self.state.valid_bytes)
                self.state.dropped_bytes = 0
            offset = self.state.valid_bytes
            n = self.writer.append(records)
        except OSError as exc:
            # The transcript is already safe; the state file only caches. Tell the user, keep going.
            self.save_error = f"could not save the KV state ({exc.strerror or exc}); the transcript is intact"
            self.state = sf.ScanResult(header=None)
            return 0
        self.save_error = ""
        added, self.state.valid_bytes = sf.records_at(records, offset)
        self.state.records.extend(added)
        if stats is not None:
            stats.save_ms += 1000 * (time.perf_counter() - t0)
        self._saved()
        return n

    def _rewrite_state(self) -> bytes | None:
        """Write the whole live state as one snapshot (compaction, shifts, recovery); returns its cells."""
        eng = self.engine
        n = eng.n_past
        recs = [self._state_header()]
        kv = eng.save_cells(0, n)
        recs.append(sf.encode_record(sf.SNAPSHOT, 0, n, sf.cells_payload(eng.tokens, kv)))
        if self.turn_logits is not None and self.turn_logits[0] <= n:
            pos, arr = self.turn_logits
            recs.append(sf.encode_record(sf.LOGITS, pos, pos, arr.astype("<f4").tobytes()))
        try:
            self.writer.rewrite(recs)
        except OSError as exc:
            self.save_error = f"could not save the KV state ({exc.strerror or exc}); the transcript is intact"
            self.state = sf.ScanResult(header=None)
            return kv
        self.save_error = ""
        st = sf.ScanResult(header={"identity": self.state_identity()})
        st.records, st.valid_bytes = sf.records_at(recs, 0)
        self.state = st
        self._saved()
        return kv

    def _saved(self) -> None:
        """Every successful state write ends here: the one place the state budget is applied."""
        if self.after_save is not None:
            text = self.after_save()
            if text:
                self._pending_notices.append(Notice(text))

    def take_notices(self) -> list[Notice]:
        """Notices raised outside a reply (e.g. by /undo, /alt): for the front end to show."""
        out, self._pending_notices = self._pending_notices, []
        return out

    def _maybe_compact(self) -> bool:
        total = self.state.valid_bytes
        live = self.state.live_bytes()
        if total - live > live:
            self._rewrite_state()
            return True
        return False

    def _touch_meta(self) -> None:
        self.meta["updated"] = time.time()
        self.meta["turns"] = self.n_turns
        self.meta["tokens"] = self.engine.n_past
        try:
            self.dir.write_meta(self.meta)
        except OSError as exc:
            self.save_error = f"could not update metadata ({exc.strerror or exc})"

    def close(self) -> None:
        self.dir.unlock()


def _cut_stop(text: str, stops: Sequence[str]) -> str | None:
    for s in stops:
        i = text.find(s)
        if i >= 0:
            return text[:i].rstrip()
    return None


def _make_title(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= 60 else line[:57].rstrip() + "…"
