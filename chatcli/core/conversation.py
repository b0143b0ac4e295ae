"""A conversation: the policy of turns, alternatives, rollbacks and context shifts.

It keeps three things equal: the transcript (``transcript.py``, fsynced, the truth), the backend's
sequence (``backend.py``: what the context holds) and the saved KV state (``kv/log.py``, chosen by the
backend's capabilities). Every change is written to the transcript first, then made to the backend,
then handed to the state log.

Operations are generators of events (``events.py``) that front ends render; nothing here prints.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Any, Callable, Generator, Iterator, Mapping, Sequence

from chatcli.core.backend import Backend, BackendError, Sampling
from chatcli.core.events import (
    ConversationError,
    Event,
    MessageTooLongError,
    Notice,
    Progress,
    ReplyEnd,
    ReplyText,
    ResumeReport,
    SessionStats,
    TurnStats,
)
from chatcli.core.files.store import ConversationDir
from chatcli.core.kv import budget, prefix, rebuild
from chatcli.core.kv.log import StateLog, make_state_log
from chatcli.core.reply import (
    Draft,
    closing_tokens,
    make_title,
    reasoning_parts,
    reply_seed,
    returned_tokens,
    stream_reply,
)
from chatcli.core.steps import evaluate, finish, to_the_end
from chatcli.core.template import ChatTemplate, Message, ReasoningStream
from chatcli.core.transcript import ActiveMessage, Replay, Transcript
from chatcli.core.views import ConversationViews
from chatcli.units import counted

# A compaction of the state file keeps the cells of this many of the last turn's other replies (the newest):
# /alt to them reads the cells back; to older ones it evaluates the reply again.
SPARE_ALTS = 4
# The user message's cells are written with its reply's, at the reply's end: one append and one fsync, and
# nothing between two tokens of the stream (the write took 11-34 ms of a 96-token reply's 1.3 s: 1-2 % of
# its decoding rate). A reply still streaming this long after its first token writes them then, so that a
# process killed during a long reply still finds them; one killed sooner evaluates the message again when the
# conversation resumes (the transcript holds it), which costs no more than the user had waited for it.
LATE_SAVE_SECONDS = 2.0
_DONE = float("inf")


class Conversation(ConversationViews):
    """One open conversation bound to the process's backend. Holds the conversation's lock until closed."""

    def __init__(
        self, engine: Backend, template: ChatTemplate, conv: ConversationDir, meta: dict[str, Any], replay: Replay,
        sampling: Sampling, *, identity: dict[str, Any], max_tokens: int = 1024, reserve: int = 256,
    ) -> None:
        self.backend = engine
        self.template = template
        self.dir = conv
        self.meta = meta
        self.transcript = Transcript(conv, replay)
        self.sampling = sampling
        self.identity = identity
        self.max_tokens = max_tokens
        self.reserve = reserve
        self.log: StateLog = make_state_log(
            engine, state_path=conv.state_path, identity=self.state_identity(), meta=meta,
            checkpoint_name=f"chatcli-{conv.id}-{secrets.token_hex(4)}")
        self.last_stats: TurnStats | None = None
        self.session_stats = SessionStats()
        self._stop_strings = template.reply_stop_strings()
        self._warned_no_shift = False
        self._rolled_again = 0  # tokens the last rollback evaluated again (no saved point was left there)
        self._meta_error = ""
        self._failures: list[str] = []  # save failures not yet reported (the log keeps its own)
        # Set by the Session: called after every successful state write (the state budget); returns a line
        # to show, or None. Its notices are yielded before the next ReplyEnd, or taken by the front end.
        self.after_save: Callable[[], str | None] | None = None
        self._pending_notices: list[Notice] = []
        self._meta_due = False  # the metadata changed while writes are held (``defer_writes``): ``commit`` writes it
        # The end of a reply, in the transcript, not decoded yet (held writes: see ``_reply``): its last sampled
        # token (the first ``_due_sampled`` tokens) and the template's closing. The next user message is
        # evaluated with them, any other operation decodes them first (``_settle_closing``).
        self._closing_due: list[int] = []
        self._due_sampled = 0
        self.log.on_saved = self._saved
        self.log.replan = lambda: rebuild.segments(len(self.r.prefix_tokens), list(self.r.active), self._closing_len)
        self.log.reusable = self._reusable

    def _reusable(self) -> list[tuple[int, list[int]]]:
        """What /redo and /alt can put back from here, for the state log's compaction to keep
        (``StateLog.reusable``): the last turn's other replies (the newest ``SPARE_ALTS``), each entry of the
        redo stack in the order redo brings them back, and the other replies of the turn each entry ends
        with. The redo stack is bounded by the context (its messages were in it with the live ones) and is
        cleared by the next message, edit, /regen or /alt; the next compaction after that drops its cells."""
        last = self.r.active[-1] if self.r.active else None
        if not self.r.redo and (last is None or (last.alt == 0 and last.mid == self.r.next_mid - 1)):
            return []  # a plain turn (its reply is the newest message, the turn's first): nothing to scan
        seq = self.r.tokens()
        out: list[tuple[int, list[int]]] = []
        reply = (last.mid, last.p0) if last is not None and last.role == "assistant" else None
        out.extend(self._other_replies(seq, reply))
        for mids in reversed(self.r.redo):
            p0 = len(seq)
            reply = None
            for m in mids:
                if self.r.all[m]["role"] == "assistant":
                    reply = (m, len(seq))
                seq = seq + [int(t) for t in self.r.all[m]["tokens"]]
            out.append((p0, seq))
            # Once redone, this entry's last reply is the last turn's: its other replies are /alt's.
            out.extend(self._other_replies(seq, reply if reply is not None and reply[0] == mids[-1] else None))
        return out

    def _other_replies(self, seq: list[int], reply: tuple[int, int] | None) -> list[tuple[int, list[int]]]:
        """``_reusable``'s entries for the other replies of the turn whose reply ``(mid, p0)`` ends ``seq``."""
        if reply is None:
            return []
        mid, p0 = reply
        alts = sorted((e for e in self.r.alternatives(int(self.r.all[mid].get("turn", -1))) if int(e["mid"]) != mid),
                      key=lambda e: int(e["mid"]))
        return [(p0, seq[:p0] + [int(t) for t in e["tokens"]]) for e in alts[-SPARE_ALTS:]]

    # -- loading the backend (see opening.py for creating and opening) ---------------------------------

    def state_identity(self) -> dict[str, Any]:
        return prefix.state_identity(self.identity, self.backend.identity())

    def start(self, cache_file: Path | None, *, keep: bool = False) -> Iterator[Event]:
        """Put a new conversation's persona prefix in the backend (from the prefix cache when it can).
        ``keep``: the backend holds another conversation whose cells were computed where they are (none was
        moved by a context shift); what the new one starts with the same is taken up, not evaluated again
        (``Backend.forget``)."""
        if keep:
            self.backend.forget()
        else:
            self.backend.clear()
        yield from self.log.start(self.r.prefix_tokens, cache_file)
        if self.log.meta_changed:
            self._touch_meta()
        yield from self._notices()

    def restore(self, report: ResumeReport) -> Iterator[Event]:
        """Make the backend hold this conversation again, loading what was saved, evaluating the rest."""
        eng = self.backend
        eng.clear()
        for i, m in enumerate(self.r.active):
            if any(not 0 <= t < eng.n_vocab for t in m.tokens):
                # A damaged message cannot be evaluated: keep everything before it, say what was dropped.
                # Transcript first, like every change: the turns typed next then start where the context
                # ends, and survive reopening (and show / export see what the context holds).
                dropped = self.r.active[i:]
                self.transcript.append({"type": "truncate", "to": m.p0, "reason": "invalid"})
                yield Notice(f"transcript message {m.mid} holds invalid token ids: it and "
                             f"{counted(len(dropped) - 1, 'later message')} were left out of the context", "warn")
                break
        want = self.r.tokens()
        # A conversation that fills the context exactly still opens: the next message shifts, a regen or
        # an undo frees cells first (replies never take the cells their closing needs, see _reply).
        if len(want) > eng.n_ctx:
            raise ConversationError(f"conversation holds {len(want)} tokens but the context is {eng.n_ctx}: "
                                    f"resume with --n-ctx {len(want) + self.reserve}")
        # Lazily: the plan only matters for what the state file does not hold (usually nothing).
        n_prefix, active = len(self.r.prefix_tokens), list(self.r.active)
        ends = [n_prefix, *(m.p0 + len(m.tokens) for m in active)]  # where a rollback can return to
        yield from self.log.restore(want, report, lambda: rebuild.segments(n_prefix, active, self._closing_len),
                                    points=ends, brought_back=self.r.brought_back)
        if report.reason == "no saved state" and budget.was_evicted(self.meta):
            report.reason = "its KV state was dropped to keep within the state budget"
        if self.log.meta_changed:
            self._touch_meta()
        self._remember_state_params()
        yield from self._notices()

    def _closing_room(self) -> int:
        """The most cells a reply's closing can take: the template's whole closing of an empty reply."""
        closing = self.template.closing([*self.history(), Message("assistant", "")])
        return len(self.backend.tokenize(closing, add_special=False)) if closing else 0

    def _closing_len(self, i: int) -> int:
        """How many tokens at the end of reply ``i`` are the template's closing (evaluated as one batch)."""
        m = self.r.active[i]
        history = [*self.r.persona_messages, *(x.as_message() for x in self.r.active[:i])]
        for n in range(0, min(len(m.tokens) - 1, 16) + 1):
            reply = m.tokens[:len(m.tokens) - n]
            if closing_tokens(self.backend, self.template, history, m.text, reply, m.stop) == m.tokens[len(reply):]:
                return n
        return 0  # the closing did not fit in the context (or the template changed): all decoded one by one

    def _remember_state_params(self) -> None:
        """The metadata says which KV format the saved state holds (resuming with another --kv-type changes
        it) and forgets an eviction once the state is back."""
        params = self.backend.identity()
        if self.meta.get("params") == params and "evicted" not in self.meta:
            return
        self.meta["params"] = params
        self.meta.pop("evicted", None)
        try:
            self.dir.write_meta(self.meta)
        except OSError as exc:
            self._meta_error = f"could not update metadata ({exc.strerror or exc})"

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

    def __enter__(self) -> Conversation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.unlock()

    # A server answers a reply's end before its state is written (the transcript, the truth, is written
    # first either way): ``defer_writes`` keeps each reply's cells and the metadata back, ``commit`` writes
    # them. Every operation commits first, and so does ``unlock``: another process never finds the state
    # file behind while it holds the lock (but for a reply's closing, 1-2 tokens a resume evaluates), and
    # nothing changes the context before its cells are read out.
    def defer_writes(self, on: bool = True) -> None:
        """Keep a reply's state records and the metadata back until ``commit`` (``on``), or not (writes
        what was kept back)."""
        if not on:
            self.commit()
        self.log.hold = on

    def commit(self) -> None:
        """Write what ``defer_writes`` kept back: the turn's cells (and logits), then the metadata. A failure
        is said by the next operation, as any failed save is. A reply's closing stays due: what is written
        is what the context holds (a resume evaluates the closing's 1-2 tokens)."""
        try:
            self.log.commit()
        except (BackendError, OSError) as exc:
            # The cells could not be read out (the context failed meanwhile): the state file only lags
            # behind the transcript, which a restore catches up on.
            self._failures.append(f"could not save the KV state ({exc}); the transcript is intact")
        if self._meta_due:
            self._meta_due = False
            self._meta_fields()
            self._write_meta()

    def close_reply(self) -> None:
        """Decode a reply's end still due (its last token, its closing) and save its cells (a server shutting
        down: the state file then holds the whole conversation, and its next resume evaluates nothing)."""
        self._settle_closing()
        self._touch_meta()

    def _settle_closing(self) -> None:
        """Decode a reply's end still due (see ``_reply``) and save its cells: before anything but the next
        user message touches the context. Its sampled token is decoded alone and the closing in one call, as
        the rebuild plan has them (rebuild.py). Tokens that cannot be decoded raise (``BackendError``): the
        context then no longer holds what the transcript says, so its holder must restore the conversation
        before using it again."""
        due, self._closing_due = self._closing_due, []
        sampled, self._due_sampled = self._due_sampled, 0
        if due:
            self._decode_end(due[:sampled], due[sampled:])
            reply = self.r.active[-1]  # the reply it closes (anything appended after it folds or settles it)
            self.log.cells_evaluated(reply.p0, reply.p1)

    def _decode_end(self, sampled: list[int], closing: list[int]) -> None:
        """A reply's end as the rebuild plan has it (rebuild.py): each sampled token alone, the closing in one call."""
        for tok in sampled:
            finish(evaluate(self.backend, [tok], "closing the reply"))
        if closing:
            finish(evaluate(self.backend, closing, "closing the reply"))

    # A long-lived process (the server) keeps a conversation open between requests without holding it:
    # ``unlock`` lets ``chatcli resume`` take it meanwhile, ``lock`` takes it back (LockedError if taken).
    def lock(self) -> None:
        """Take the conversation's lock again (after ``unlock``); raises LockedError if another has it."""
        self.dir.lock()

    def unlock(self) -> None:
        """Let go of the conversation's lock (writing what was kept back first); the object stays usable
        once ``lock`` takes it again."""
        try:
            self.commit()
        finally:
            self.dir.unlock()

    def reload_meta(self) -> None:
        """Take the metadata another process wrote since (a title set in the REPL): the next write of this
        copy's metadata would revert it otherwise."""
        self.meta = self.dir.read_meta()

    # -- sending -----------------------------------------------------------------------------------

    def send(self, text: str, *, seed: int | None = None) -> Iterator[Event]:
        """Add a user message and stream the reply."""
        self.commit()
        if self.pending_user:
            raise ConversationError("the last message has no reply yet: /regen to generate it")
        yield from self._send(text, self._user_tokens(self.r.active, text), seed)

    def _user_tokens(self, before: list[ActiveMessage], text: str) -> list[int]:
        """The tokens of a new user message after ``before``; refuses empty text."""
        if not text.strip():
            raise ConversationError("empty message")
        history = [*self.r.persona_messages, *(m.as_message() for m in before)]
        return self.backend.tokenize(self.template.user_turn(history, text), add_special=False)

    def _send(self, text: str, tokens: list[int], seed: int | None) -> Iterator[Event]:
        self.backend.reset_cancel()
        stats = TurnStats()
        eng = self.backend
        if self._closing_due and self._plan_room(self._n_past, self.r.active, len(tokens))[0]:
            self._settle_closing()  # a context shift moves whole messages, closings included
        yield from self._make_room(len(tokens), stats)
        turn = self.r.max_turn + 1
        closing = len(self._closing_due)
        p0 = eng.n_past + closing
        # Transcript first: whatever happens next, the user's words are on disk. A bar only for messages
        # that take more than one batch.
        stats.prompt_seconds = yield from self._append_evaluated("user", text, tokens, turn,
                                                                 label="reading your message", bar_above=eng.n_batch)
        # What this call evaluated (llama-server's prompt_n counts a closing too): not what a new conversation's
        # first message took up from the context's last conversation (``start``).
        stats.n_prompt = closing + len(tokens) - self.r.active[-1].taken
        self.log.user_evaluated(p0, tokens, stats, defer=True, closing=closing)  # written with the reply
        yield from self._notices()
        if not self.title:
            self.meta["title"] = make_title(text)
        yield from self._reply(turn, alt=0, stats=stats, seed=seed)

    def _reply(self, turn: int, *, alt: int, stats: TurnStats, seed: int | None) -> Iterator[Event]:
        eng = self.backend
        stats.reevaluated = (stats.reevaluated or 0) + (yield from self.log.before_reply())
        # No --seed: each alternative gets its own seed (a new reply every /regen). An explicit --seed makes
        # the reply reproducible: the same seed gives the same reply whichever alternative it becomes.
        use_seed = reply_seed(self.seed, turn, alt) if seed is None else reply_seed(seed, turn, 0)
        p0 = eng.n_past
        draft = Draft()
        res = draft.result
        # A reply never takes the cells its closing needs: a reply that would fill the context stops short
        # of it, so the conversation stays whole (it opens, regenerates and shifts like any other).
        room = eng.n_ctx - eng.n_past - self._closing_room()
        limit = max(0, min(self.max_tokens, room))
        # If our consumer stops listening (closes us, or dies with an error), the reply produced so far is
        # still recorded like a Ctrl-C'd one: the context and the transcript must never disagree.
        abandoned = False
        failed: BackendError | None = None
        # A server (held writes) leaves the reply's end to the next prompt, as llama-server does: its last
        # sampled token is not decoded either (below). A memory that cannot be cut back saves its point after
        # the closing: decoded now, as in the REPL.
        defer = self.log.hold and eng.caps.truncate
        stream = stream_reply(eng, self.sampling, draft, seed=use_seed, max_tokens=limit,
                              stop_strings=self._stop_strings, turn=turn, alt=alt,
                              reasoning=ReasoningStream(self.template), defer_last=defer)
        late_save: float | None = None  # when the user message's cells are written if the reply still runs
        try:
            try:
                for ev in stream:
                    yield ev
                    if isinstance(ev, ReplyText) and late_save != _DONE:
                        now = time.monotonic()
                        if late_save is None:
                            late_save = now + LATE_SAVE_SECONDS
                        elif now >= late_save:
                            late_save = _DONE  # once: nothing else is kept back until the reply's end
                            self.log.flush()
            finally:
                stream.close()
        except GeneratorExit:
            abandoned = True
        except BackendError as exc:
            # The engine failed mid-reply (a remote server died): what it delivered is recorded like a
            # Ctrl-C'd reply, then the error goes on to the front end.
            failed = exc
            res.stop_reason = "cancelled"
        if abandoned and res.stop_reason in ("", "eog", "stop", "length"):
            res.stop_reason = res.stop_reason or "cancelled"
        if res.stop_reason == "length" and limit < self.max_tokens:
            res.stop_reason = "context"  # stopped by the room left, not by max_tokens
        # The reply's last sampled token, not decoded (``defer``): it stays due with the closing.
        last = list(res.undecoded)
        if failed is not None and last:
            try:
                for tok in last:
                    finish(evaluate(eng, [tok], "rebuilding the reply"))
            except BackendError:
                pass  # the engine is gone: the reply is kept as far as the context holds it
            last = []
        if draft.cut and failed is None:
            last = self._back_to_returned(p0, draft.text, last, defer=defer)
            res.stop_reason = "stop"
        reply_tokens = [*eng.tokens[p0:], *last]
        # Close the reply now (e.g. the "\n" after <|im_end|>) so every message holds its whole rendering:
        # then whole exchanges can be dropped by a context shift without leaving half a turn behind.
        try:
            closing = closing_tokens(eng, self.template, self.history(), draft.text, reply_tokens, res.stop_reason)
        except BackendError:
            if failed is None:
                raise
            closing = []  # a dead server cannot tokenize the closing: the partial reply is kept without it
        if eng.n_past + len(last) + len(closing) > eng.n_ctx:
            closing = []  # the closing does not fit (never: a reply leaves it room): the reply is kept without it
        if defer and failed is None and (last or closing):
            # Not decoded now: a server sends the reply's end, writes what was computed, and the next user
            # message is evaluated with these tokens in one call, as llama-server evaluates a slot's last
            # sampled token and the closing with the next prompt (two decodes less per turn); any other
            # operation decodes them first. The transcript names them already.
            self._closing_due, self._due_sampled = [*last, *closing], len(last)
        else:
            # Unseen: a few tokens, and this generator may have been closed already (an abandoned reply).
            self._decode_end(last, closing)
        reply_tokens = [*eng.tokens[p0:], *self._closing_due]
        stats.server_evaluated = res.n_prompt_evaluated
        stats.server_cached = res.n_prompt_cached
        if stats.kept is not None and res.n_prompt_evaluated is not None:
            # A reply after a rollback (regen): every prompt token the server evaluated was already in the
            # history, so that is what the rollback really cost, whatever it cost on this side.
            stats.reevaluated = (stats.reevaluated or 0) + res.n_prompt_evaluated
        # Time to first token as the user feels it: reading their message plus sampling the first token.
        stats.ttft = stats.prompt_seconds + res.ttft
        stats.n_generated = len(res.tokens)
        stats.gen_seconds = res.seconds
        stats.decode_seconds = max(0.0, res.last_shown - res.first_shown) if res.first_shown >= 0 else 0.0
        stats.stop_reason = res.stop_reason
        stats.n_eval += stats.n_prompt + len(reply_tokens) - len(self._closing_due)  # a closing due: the next turn's
        try:
            parts = reasoning_parts(eng, self.template, draft.text, reply_tokens)
        except BackendError:
            parts = None  # a dead server cannot name the reasoning's tokens: the reply is kept whole
        try:
            msg = self.transcript.message("assistant", draft.text, reply_tokens, p0, turn, alt=alt,
                                          stop=res.stop_reason, parts=parts)
        except OSError:
            # Not in the transcript means not in the conversation: the context must not keep it either.
            self._closing_due, self._due_sampled = [], 0
            finish(self.log.rollback(p0, persist=False))
            raise
        self.log.reply_done(p0, eng.tokens[p0:], stats)  # what the context holds (without the end still due)
        self._touch_meta()
        stats.n_past = self._n_past
        stats.n_ctx = eng.n_ctx
        self.last_stats = stats
        self.session_stats.add(stats)
        if failed is not None:
            raise failed
        if abandoned:
            return  # a closed generator must not yield again (what went wrong is said by the next operation)
        yield from self._notices()
        yield ReplyEnd(msg, stats)

    def _back_to_returned(self, p0: int, text: str, undecoded: list[int], *, defer: bool) -> list[int]:
        """A stop string was cut from the reply: roll the context back to the text returned, so later turns
        (and a client sending the same visible history) see what was shown, not the stop string, the rest
        of its token or the whitespace stripped before it. Tokens re-added are decoded one by one, as
        sampled ones are, so a rebuild's batching (rebuild.py) still matches. ``undecoded``: the sampled
        tokens after the context's (``defer_last``). Returns the reply's last token when it is left due
        (``defer``: not decoded, as a sampled last one), else nothing."""
        eng = self.backend
        sampled = [*eng.tokens[p0:], *undecoded]
        k, rest = returned_tokens(eng, sampled, text)
        kept = min(k, eng.n_past - p0)  # sampled tokens kept that the context holds
        rest = [*sampled[kept:k], *rest]
        if eng.caps.truncate:
            eng.truncate(p0 + kept)
        else:
            # A memory that cannot be cut back mid-reply: back to the reply's start (a saved point), then
            # the kept tokens again, one by one as they were sampled.
            rest = [*eng.tokens[p0:p0 + kept], *rest]
            finish(self.log.rollback(p0, persist=False))
        due = rest[-1:] if defer else []
        for tok in rest[:len(rest) - len(due)]:
            finish(evaluate(eng, [tok], "rebuilding the reply"))
        return due

    def cancel(self) -> None:
        self.backend.cancel()

    # -- requests from an API front end ---------------------------------------------------------------
    # A stateless client sends the whole history: messages it wrote itself (or took from elsewhere) are
    # appended without generating, exactly as a REPL turn would have stored them (transcript first, then
    # the state records), so the same history always gives the same token ids.

    @property
    def stop_strings(self) -> list[str]:
        """Where a reply is cut: the template's end-of-reply strings plus the extra ones set per request."""
        return list(self._stop_strings)

    def set_options(self, *, sampling: Sampling | None = None, max_tokens: int | None = None,
                    extra_stop: Sequence[str] = ()) -> None:
        """Options for the replies that follow: sampling, reply length, and stop strings added to the
        template's own (a reply is cut at them like at the template's, and they are not kept in it)."""
        if sampling is not None:
            self.sampling = sampling
        if max_tokens is not None:
            self.max_tokens = max_tokens
        self._stop_strings = [*self.template.reply_stop_strings(), *extra_stop]

    def update_meta(self, fields: Mapping[str, Any]) -> None:
        """Merge ``fields`` into the metadata and write it (e.g. where a conversation came from)."""
        self.meta.update(fields)
        self._touch_meta()

    def append_user(self, text: str) -> Iterator[Progress]:
        """Add a user message without replying to it (a client sent a history holding its own replies).

        Stored as ``send`` stores one before it samples: transcript, then the cells and the logits after it
        (a later ``regen`` samples from those, nothing evaluated). Yields after each evaluated batch; closing
        the iterator there takes the message back out, as a failed ``send`` does. Refused before anything
        is written when it does not fit the context with ``reserve`` tokens left (no shift here).
        """
        self.commit()
        tokens = self._user_tokens(self.r.active, text)
        self._check_fits(tokens)
        turn = self.r.max_turn + 1
        closing = len(self._closing_due)
        yield from self._append_evaluated("user", text, tokens, turn)
        self.log.user_evaluated(self.r.active[-1].p0, tokens, TurnStats(), closing=closing)
        if not self.title:
            self.meta["title"] = make_title(text)

    def append_reply(self, text: str) -> Iterator[Progress]:
        """Add a reply the client wrote (or edited) to the last user message: the template's rendering
        of it, closing included, recorded as a new alternative of that turn (``stop`` = "client").
        Iterated and closed like ``append_user``."""
        self.commit()
        if not self.pending_user:
            raise ConversationError("a reply must follow a user message")
        self._settle_closing()  # none is due after a user message: kept for the rule (see _settle_closing)
        closing = self.template.closing([*self.history(), Message("assistant", text)])
        tokens = self.backend.tokenize(text + closing, add_special=False)
        self._check_fits(tokens)
        turn = self.r.active[-1].turn
        yield from self._append_evaluated("assistant", text, tokens, turn, alt=len(self.r.alternatives(turn)),
                                          stop="client")
        self.log.reply_done(self.r.active[-1].p0, tokens, TurnStats())
        self._touch_meta()

    def _check_fits(self, tokens: Sequence[int]) -> None:
        eng = self.backend
        if self._n_past + len(tokens) + self.reserve > eng.n_ctx:
            raise MessageTooLongError(f"the history does not fit the context ({self._n_past + len(tokens)} tokens, "
                                   f"n_ctx {eng.n_ctx})")

    @property
    def _n_past(self) -> int:
        """The conversation's length: the context's, with a reply's end still due."""
        return self.backend.n_past + len(self._closing_due)

    def _taken(self, tokens: list[int]) -> int:
        """How many of a message's tokens its evaluation takes up from cells ``start`` kept (``Backend.kept``);
        none once the conversation evaluated anything after its prefix (a reply's end is never due then)."""
        return 0 if self._closing_due else self.backend.kept(tokens)

    def _append_evaluated(self, role: str, text: str, tokens: list[int], turn: int, *, alt: int = 0,
                          stop: str = "", label: str = "reading the history",
                          bar_above: int = 0) -> Generator[Progress, None, float]:
        """Record a message (transcript first) and evaluate it, a ``Progress`` per batch when it has more than
        ``bar_above`` tokens; returns the seconds the evaluation took. A user message is evaluated with a
        reply's end still due (its last token, its closing), in one call (the transcript says how many tokens
        came before the message: rebuild.py replays it)."""
        eng = self.backend
        if role != "user":
            self._settle_closing()
        closing, sampled = self._closing_due, self._due_sampled
        c0 = eng.n_past
        p0 = c0 + len(closing)
        self.transcript.message(role, text, tokens, p0, turn, alt=alt, stop=stop, with_closing=len(closing),
                                taken=self._taken(tokens))
        self._closing_due, self._due_sampled = [], 0
        try:
            seconds = yield from evaluate(eng, [*closing, *tokens], label, stoppable=True, above=bar_above)
        except BaseException:
            # Closed early or failed: not in the context means not in the conversation (kept in the
            # transcript, out of the active path; a front end gives the text back to the user). The context
            # goes back to where it was, the closing due again.
            self.transcript.append({"type": "truncate", "to": p0, "reason": "failed"})
            if eng.n_past > c0:
                finish(self.log.rollback(c0, persist=False))  # on the way out: nothing can be shown
            self._closing_due, self._due_sampled = closing, sampled
            raise
        return seconds

    # -- rollback ---------------------------------------------------------------------------------

    def regen(self, *, seed: int | None = None) -> Iterator[Event]:
        """Sample a new reply to the last user message; the old one stays as an alternative."""
        self.commit()
        self.backend.reset_cancel()
        if not self.r.active:
            raise ConversationError("nothing to regenerate yet")
        self._settle_closing()  # the reply becomes an alternative: its cells whole, for /alt to read back
        stats = TurnStats()
        last = self.r.active[-1]
        turn = last.turn
        if last.role == "assistant":
            user_msg = self.r.active[-2] if len(self.r.active) >= 2 else None
            if user_msg is None or user_msg.role != "user":
                raise ConversationError("the last reply is part of the persona and cannot be regenerated")
            stats.dropped = yield from self._truncate(last.p0, "regen")
            yield from self._notices()
        else:
            stats.dropped = self._rolled_again = 0
        stats.kept = self.backend.n_past
        alt = len(self.r.alternatives(turn))
        stats.reevaluated = self._rolled_again
        yield from self._reply(turn, alt=alt, stats=stats, seed=seed)

    def _settled(self, stats: TurnStats) -> TurnStats:
        """End of a rollback that returns its result: compact or checkpoint, save meta, report failures."""
        self.log.settle()
        self._touch_meta()
        stats.notices = self._notices()
        return stats

    def _truncate(self, to: int, reason: str) -> Generator[Progress, None, int]:
        """Roll back to ``to`` (recorded first); a ``Progress`` per step of a rebuild from a saved point.
        Returns the positions dropped."""
        dropped = self.backend.n_past - to
        self.transcript.append({"type": "truncate", "to": to, "reason": reason})
        self._rolled_again = yield from self.log.rollback(to)
        return dropped

    # /undo, /redo and /alt return their result (a ``TurnStats``), not a reply. Each has two forms: ``undo``
    # runs the steps unseen (``finish``); ``undo_steps`` checks everything at once (a refusal raises before
    # anything changes) and returns a generator of the ``Progress`` of what the rollback evaluates (a memory
    # that cannot be cut back may rebuild from a saved point), whose value is the ``TurnStats``. Nothing
    # changes until it is iterated; closed once started, it runs the rest unseen (``to_the_end``): the
    # operation is recorded in the transcript before the rebuild, so it must not stop halfway.

    def undo(self, n: int = 1) -> TurnStats:
        """Remove the last ``n`` exchanges (kept in the transcript as undone; /redo brings them back)."""
        return finish(self.undo_steps(n))

    def undo_steps(self, n: int = 1) -> Generator[Progress, None, TurnStats]:
        """``undo`` with a ``Progress`` per step of the rebuild it may need (see above)."""
        self.commit()
        users = self.user_messages()
        if n < 1:
            raise ConversationError("undo needs a positive count")
        if len(users) < n:
            raise ConversationError(f"only {counted(len(users), 'exchange')} to undo")
        return to_the_end(self._undo(users[-n].p0))

    def _undo(self, to: int) -> Generator[Progress, None, TurnStats]:
        self._settle_closing()  # the exchanges undone keep their cells whole, for /redo to read back
        stats = TurnStats(kept=to, reevaluated=0)
        stats.dropped = yield from self._truncate(to, "undo")
        stats.reevaluated = self._rolled_again
        return self._settled(stats)

    def redo(self) -> TurnStats:
        """Bring back the exchanges the last /undo removed."""
        return finish(self.redo_steps())

    def redo_steps(self) -> Generator[Progress, None, TurnStats]:
        """``redo`` with a ``Progress`` per step of what it evaluates (cells the state file no longer has)."""
        self.commit()
        if not self.r.redo:
            raise ConversationError("nothing to redo")
        mids = self.r.redo[-1]
        total = sum(len(self.r.all[m]["tokens"]) for m in mids)
        if self._n_past + total > self.backend.n_ctx:
            raise ConversationError("the undone exchanges no longer fit in the context")
        return to_the_end(self._redo(list(mids)))

    def _redo(self, mids: list[int]) -> Generator[Progress, None, TurnStats]:
        self._settle_closing()
        stats = TurnStats(kept=self.backend.n_past, dropped=0)
        tokens: list[int] = []
        p0 = self.backend.n_past
        for i, mid in enumerate(mids):
            self.transcript.append({"type": "activate", "mid": mid, "p0": p0 + len(tokens), "redo": i == 0})
            tokens.extend(int(t) for t in self.r.all[mid]["tokens"])
        stats.n_eval = stats.reevaluated = len(tokens) - (yield from self.log.put_back(tokens))
        return self._settled(stats)

    def switch_alt(self, index: int) -> TurnStats:
        """Make alternative ``index`` (0-based) of the last turn the active reply."""
        return finish(self.switch_alt_steps(index))

    def switch_alt_steps(self, index: int) -> Generator[Progress, None, TurnStats]:
        """``switch_alt`` with a ``Progress`` per step of the rollback's rebuild and of the reply's cells
        evaluated again (when the state file no longer has them)."""
        self.commit()
        alts = self.alternatives()
        if not alts:
            raise ConversationError("no reply to switch")
        if not 0 <= index < len(alts):
            raise ConversationError(f"no alternative {index + 1} (this turn has {len(alts)})")
        return to_the_end(self._switch_alt(alts[index].mid, alts[index].active))

    def _switch_alt(self, mid: int, active: bool) -> Generator[Progress, None, TurnStats]:
        if active:
            return TurnStats(kept=self._n_past, dropped=0, reevaluated=0)
        self._settle_closing()  # the reply switched from keeps its cells whole, for /alt to read back
        to = self.r.active[-1].p0
        stats = TurnStats(kept=to)
        stats.dropped = yield from self._truncate(to, "alt")
        self.transcript.append({"type": "activate", "mid": mid, "p0": to})
        toks = [int(t) for t in self.r.all[mid]["tokens"]]
        stats.n_eval = len(toks) - (yield from self.log.put_back(toks))
        stats.reevaluated = self._rolled_again
        return self._settled(stats)

    def edit(self, n: int | None, text: str, *, seed: int | None = None) -> Iterator[Event]:
        """Replace user message ``n`` (1-based; default the last) and continue from it.

        Everything is checked before anything changes: the index, the text, and that the new message fits
        the context once the messages after it are gone (a refused edit leaves the conversation as it was).
        """
        self.commit()
        users = self.user_messages()
        if not users:
            raise ConversationError("no message to edit")
        idx = len(users) if n is None else n
        if not 1 <= idx <= len(users):
            raise ConversationError(f"no message {idx} (there are {len(users)})")
        target = users[idx - 1]
        before = self.r.active[:self.r.active.index(target)]
        tokens = self._user_tokens(before, text)
        self._plan_room(target.p0, before, len(tokens))  # raises MessageTooLongError if it cannot fit
        if self.title == make_title(target.text):
            # The title was made from the message being replaced (not set by the user): it follows the edit.
            self.meta["title"] = make_title(text)
        self._settle_closing()  # what the edit cuts keeps its cells whole, for /redo to read back
        yield from self._truncate(target.p0, "edit")
        yield from self._notices()
        yield from self._send(text, tokens, seed)

    def set_title(self, title: str) -> None:
        self.commit()
        old = self.meta.get("title")
        self.meta["title"] = title.strip()[:120]
        self._touch_meta()
        self.commit()  # the title is written now, held writes or not (its failure is said here)
        if self._meta_error:
            self.meta["title"] = old
            self._failures.clear()
            raise ConversationError(f"the title was not changed: {self._meta_error}")

    # -- context shift ------------------------------------------------------------------------------

    def _plan_room(self, n_past: int, active: list[ActiveMessage], n_new: int) -> tuple[int, int]:
        """Tokens (and messages) to drop from the oldest exchanges so ``n_new`` tokens fit after
        ``active`` (which ends at ``n_past``); (0, 0) when they fit as it is. Raises MessageTooLongError."""
        n_ctx = self.backend.n_ctx
        if n_past + n_new + self.reserve <= n_ctx:
            return 0, 0
        keep = len(self.r.prefix_tokens)
        budget = n_ctx - self.reserve - n_new
        if keep + n_new + 1 > n_ctx or budget < keep:
            raise MessageTooLongError(
                f"message too long: {n_new} tokens, at most {max(0, n_ctx - keep - self.reserve)} fit "
                f"(n_ctx {n_ctx}, persona {keep}, reserve {self.reserve})")
        # Drop the oldest whole exchanges until what is left fits.
        drop = i = 0
        while n_past - drop > budget and i < len(active):
            drop += len(active[i].tokens)
            i += 1
            while i < len(active) and active[i].role != "user":
                drop += len(active[i].tokens)
                i += 1
        if n_past - drop > budget:
            raise MessageTooLongError("message does not fit even after dropping all earlier turns")
        return drop, i

    def _make_room(self, n_new: int, stats: TurnStats) -> Iterator[Event]:
        eng = self.backend
        drop, n_msgs = self._plan_room(eng.n_past, self.r.active, n_new)
        if not drop:
            return
        keep = len(self.r.prefix_tokens)
        self.transcript.append({"type": "shift", "keep": keep, "drop": drop})
        if eng.caps.shift:
            eng.shift(keep, drop)
            yield Notice(f"context full: {counted(n_msgs, 'oldest message')} ({drop} tokens) left the context; "
                         f"kept the persona and {eng.n_past - keep} tokens, nothing re-evaluated", "info")
        else:
            kept = eng.tokens[keep + drop:]
            yield from self.log.rollback(keep)
            if not self._warned_no_shift:
                why = {"attention": "cannot be shifted"}.get(eng.caps.memory, f"({eng.caps.memory}) cannot be shifted")
                yield Notice(f"context full and this model's memory {why}: {counted(n_msgs, 'oldest message')} "
                             f"({drop} tokens) left; rebuilding the kept {len(kept)} tokens", "warn")
                self._warned_no_shift = True
            yield from to_the_end(evaluate(eng, kept, "rebuilding context"))  # the shift is recorded already
            stats.reevaluated = (stats.reevaluated or 0) + len(kept)
        self.log.shifted()

    # -- metadata ------------------------------------------------------------------------------------

    def _notices(self) -> list[Notice]:
        """Save failures since the last call, as warnings, said by the operation that hit them (once), and
        any other pending notice (the state budget)."""
        texts = list(dict.fromkeys([*self.log.failures, *self._failures, *self.backend.take_notices()]))
        self.log.failures.clear()
        self._failures.clear()
        return [*(Notice(t, "warn") for t in texts), *self.take_notices()]

    def _touch_meta(self) -> None:
        self._meta_fields()
        if self.log.hold:
            self._meta_due = True  # written by ``commit`` (the fields above are what it writes)
            return
        self._write_meta()

    def _meta_fields(self) -> None:
        self.meta["updated"] = time.time()
        self.meta["turns"] = self.n_turns
        self.meta["tokens"] = self._n_past
        # What `chatcli ls` shows, so that it reads one small file per conversation (the transcript is on
        # disk already: every event is appended before its effect, so the stamp matches these counts).
        self.meta["summary"] = self.dir.make_summary(self.n_exchanges, self.n_turns, self.dir.transcript_stamp())

    def _write_meta(self) -> None:
        try:
            self.dir.write_meta(self.meta)
        except OSError as exc:
            self._meta_error = f"could not update metadata ({exc.strerror or exc})"
            self._failures.append(self._meta_error)
            return
        self._meta_error = ""
        self.log.meta_changed = False

