"""Which stored conversation a request continues (the server's service, in-process, real model, greedy).

One model load for the module; each test gets its own store (rebind) and its own ChatService over the
module's engine, so the tests' conversations never meet.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("starlette")

from chatcli.core.kv import budget
from chatcli.core.template import Message
from chatcli.core.transcript import replay_events
from chatcli.server.service import ChatRequest, ChatService, Finished, Started

SYSTEM = "You are terse."


# The module's model load and its ChatService per test: tests/golden.py's base_session and chat_service.
BASE_SESSION = {"threads": 2, "n_ctx": 2048, "max_tokens": 12}


def ask(svc: ChatService, msgs: list[tuple[str, str]]) -> tuple[Started, Finished]:
    started: Started | None = None
    finished: Finished | None = None
    for ev in svc.complete(ChatRequest([Message(r, c) for r, c in msgs], temperature=0.0, max_tokens=12, seed=1)):
        if isinstance(ev, Started):
            started = ev
        elif isinstance(ev, Finished):
            finished = ev
    assert started is not None and finished is not None
    assert finished.cached_tokens + finished.evaluated == finished.prompt_tokens
    return started, finished


def meta(svc: ChatService, cid: str) -> dict[str, Any]:
    return svc.store.resolve(cid).read_meta()


def test_a_new_conversation_sharing_only_the_persona_is_not_a_fork(chat_service: ChatService) -> None:
    _, a = ask(chat_service, [("system", SYSTEM), ("user", "Name a fruit.")])
    st, b = ask(chat_service, [("system", SYSTEM), ("user", "What is a ship?")])
    assert b.conversation != a.conversation
    assert (st.forked_from, b.forked_from, b.state) == (None, None, "new")
    assert "forked_from" not in meta(chat_service, b.conversation)
    # No system message at all: also new, also no parent.
    _, c = ask(chat_service, [("user", "Name a colour.")])
    _, d = ask(chat_service, [("user", "Name a city.")])
    assert (c.forked_from, d.forked_from, d.state) == (None, None, "new")
    assert "forked_from" not in meta(chat_service, d.conversation)


def test_a_cold_longest_match_loses_to_a_warm_shorter_one(chat_service: ChatService) -> None:
    """After `chatcli gc` dropped A's state: a request extending A forks the warm C at the boundary they
    share (evaluating only what comes after it) instead of rebuilding all of A."""
    s = [("system", SYSTEM)]
    _, a1 = ask(chat_service, [*s, ("user", "Name a fruit.")])
    h1 = [*s, ("user", "Name a fruit."), ("assistant", a1.text)]
    _, a2 = ask(chat_service, [*h1, ("user", "Name a colour.")])
    assert a2.conversation == a1.conversation
    _, c = ask(chat_service, [*h1, ("user", "Name an animal.")])  # an edit: C forks A after its first reply
    assert c.forked_from == a1.conversation
    store = chat_service.store
    freed = budget.enforce(store.root, None, 0, keep_ids=[c.conversation])
    assert [i.conv_id for i in freed.evicted] == [a1.conversation]
    cold = store.resolve(a1.conversation)
    assert not cold.state_path.exists()

    h2 = [*h1, ("user", "Name a colour."), ("assistant", a2.text)]
    st, f = ask(chat_service, [*h2, ("user", "Name a city.")])
    assert (f.state, f.forked_from) == ("fork", c.conversation)
    # cached = the tokens up to the shared boundary (C's first reply), all of them not evaluated.
    cr = replay_events(store.resolve(c.conversation).read_transcript().events)
    shared = cr.active[1].p1
    assert (st.cached_tokens, f.cached_tokens) == (shared, shared)
    fr = replay_events(store.resolve(f.conversation).read_transcript().events)
    assert [m.text for m in fr.active] == [m[1] for m in h2[1:]] + ["Name a city.", f.text]
    assert f.prompt_tokens == fr.active[-2].p1 and f.evaluated == f.prompt_tokens - shared
    # The cold conversation is untouched (still cold, still its own turns).
    assert not cold.state_path.exists()
    assert len(replay_events(cold.read_transcript().events).active) == 4


def test_a_cold_conversation_is_not_forked_when_nothing_warm_matches(chat_service: ChatService) -> None:
    """Nothing warm beyond the persona: an edit of a cold conversation starts a new one from the persona
    prefix (a fork would rebuild everything), and a cold conversation's own end is still continued."""
    s = [("system", SYSTEM + " (cold)")]
    _, a1 = ask(chat_service, [*s, ("user", "Name a fruit.")])
    h1 = [*s, ("user", "Name a fruit."), ("assistant", a1.text)]
    _, a2 = ask(chat_service, [*h1, ("user", "Name a colour.")])
    budget.enforce(chat_service.store.root, None, 0)  # the resident one too: it is restored from disk then
    _, e = ask(chat_service, [*h1, ("user", "Name an animal.")])
    assert (e.state, e.forked_from) == ("new", None)
    er = replay_events(chat_service.store.resolve(e.conversation).read_transcript().events)
    # Not from the cold conversation's files: the persona and the start of the first message taken up from
    # the cells the context still held (``Backend.forget``), the rest evaluated.
    assert er.active[0].taken > 0 and e.cached_tokens == len(er.prefix_tokens) + er.active[0].taken
    h2 = [*h1, ("user", "Name a colour."), ("assistant", a2.text)]
    budget.enforce(chat_service.store.root, None, 0)
    _, g = ask(chat_service, [*h2, ("user", "Name a city.")])
    assert (g.conversation, g.state, g.cached_tokens) == (a1.conversation, "disk", 0)  # rebuilt whole, honestly


def test_a_warm_boundary_whose_remaining_history_does_not_fit_is_not_chosen(chat_service: ChatService) -> None:
    """A long conversation A (shifted) is cold; its warm fork C shares only the first exchange. Continuing
    from C would append A's later messages without a shift (appends never shift): they do not fit, so the
    request continues A's own end (rebuilt) instead of failing with a 400."""
    s = [("system", SYSTEM + " (long)")]
    h = list(s)
    a = c = None
    for n, w in enumerate(("apple", "river", "stone", "cloud", "grass")):
        q = f"Count the words: {' '.join([w] * 400)}"
        _, a = ask(chat_service, [*h, ("user", q)])
        h += [("user", q), ("assistant", a.text)]
        if n == 1:  # an edit after A's first reply, before A shifts it out: a warm fork of A
            _, c = ask(chat_service, [*h[:3], ("user", "Name a colour.")])
            assert c.forked_from == a.conversation
    assert a is not None and c is not None
    assert replay_events(chat_service.store.resolve(a.conversation).read_transcript().events).out_of_context
    budget.enforce(chat_service.store.root, None, 0, keep_ids=[c.conversation])  # A's state dropped: cold
    assert not chat_service.store.resolve(a.conversation).state_path.exists()
    _, f = ask(chat_service, [*h, ("user", "Name a city.")])  # was: a fork of C, then 400 (context full)
    assert (f.conversation, f.state, f.forked_from) == (a.conversation, "disk", None)


def test_a_resent_history_is_counted_once_not_once_per_request(chat_service: ChatService,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A client resends its whole history each turn; the fit test (``_tail_fits``) counts each message's
    tokens once, not once per request and boundary (it was every earlier message at every boundary of
    every request: 7 ms of a 12-turn request, under the service's lock)."""
    eng = chat_service.engine
    seen: list[str] = []
    real = eng.tokenize

    def counting(text: str, **kw: Any) -> list[int]:
        seen.append(text)
        return real(text, **kw)

    monkeypatch.setattr(eng, "tokenize", counting)
    h = [("system", SYSTEM)]
    for q in ("Name a fruit.", "Name a colour.", "Name a city.", "Name a tree.", "Name a bird."):
        _, f = ask(chat_service, [*h, ("user", q)])
        h += [("user", q), ("assistant", f.text)]
    olds = [c for _, c in h]
    counts = {c: seen.count(c) for c in olds if c != SYSTEM}
    # Once each: as the new message it was (``_check_fits``), and never again as history after it.
    assert counts and max(counts.values()) == 1, counts
