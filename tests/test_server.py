"""`chatcli serve` end to end: a real server process, the official `openai` client, the bundled model, greedy.

One server (with an API key) serves the whole module; it is SIGKILLed and restarted by the restart test
(the fixture object follows it). A second server, never restarted and with its own data, is the reference
that replies must equal. Each test uses its own system prompt so the tests' conversations never meet in
the index.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")

from chatcli.backends.llamacpp import _LINGER  # noqa: E402
from chatcli.core.files.store import ConversationDir  # noqa: E402
from chatcli.core.kv import records as sf  # noqa: E402  (after the importorskips)
from chatcli.core.transcript import Replay, replay_events  # noqa: E402
from tests.golden import wait_written  # noqa: E402
from tests.remote_server import free_port, stop_process  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KEY = "test-key-0123456789"
N_CTX = 2048
MAX_TOKENS = 24


class Resp:
    """A plain HTTP response (stdlib client: the raw protocol, independent of the openai SDK's transport)."""

    def __init__(self, status: int, body: bytes) -> None:
        self.status_code = status
        self.text = body.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.text)


def request(port: int, method: str, path: str, body: bytes | str | None = None,
            headers: dict[str, str] | None = None, timeout: float = 60) -> Resp:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return Resp(r.status, r.read())
    finally:
        conn.close()


class Server:
    """A `chatcli serve` process on a free loopback port, with its own CHATCLI_HOME."""

    def __init__(self, home: Path, *, api_key: str | None, n_ctx: int = N_CTX, parallel: int = 1) -> None:
        self.home = home
        self.parallel = parallel
        self.api_key = api_key
        self.n_ctx = n_ctx
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = home / "server.log"

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("CHATCLI_")}
        env.update(CHATCLI_HOME=str(self.home), PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
        args = [sys.executable, "-m", "chatcli", "serve", "--port", str(self.port), "--n-ctx", str(self.n_ctx),
                "--threads", "2", "--reserve", "64", "--max-tokens", str(MAX_TOKENS), "--parallel", str(self.parallel),
                "--repl-conversations"]  # test_a_repl_conversation_is_continued_without_reingesting
        if self.api_key:
            args += ["--api-key", self.api_key]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(args, env=env, stdout=log, stderr=log, cwd=str(self.home))
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if request(self.port, "GET", "/health", headers=self.auth(), timeout=2).status_code == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError("server did not start: " + self.log.read_text()[-3000:])

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        stop_process(self.proc)

    def client(self) -> Any:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=self.api_key or "unused", max_retries=0, timeout=300)

    def conv(self, cid: str) -> ConversationDir:
        return ConversationDir(self.home / "data" / "conversations" / cid)

    def replay(self, cid: str) -> Replay:
        return replay_events(self.conv(cid).read_transcript().events)

    def ids(self) -> set[str]:
        root = self.home / "data" / "conversations"
        return {p.name for p in root.iterdir()} if root.exists() else set()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("serve") / "home", api_key=KEY, parallel=2)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Never restarted, one resident conversation, its own data: what every reply must equal."""
    srv = Server(tmp_path_factory.mktemp("reference") / "home", api_key=None)
    srv.start()
    yield srv
    srv.stop()


class Reply:
    def __init__(self, raw: Any) -> None:
        comp = raw.parse()
        self.conv = raw.headers.get("x-chatcli-conversation")
        self.text: str = comp.choices[0].message.content
        self.prompt: int = comp.usage.prompt_tokens
        self.cached: int = comp.usage.prompt_tokens_details.cached_tokens
        self.generated: int = comp.usage.completion_tokens
        self.ext: dict[str, Any] = (comp.model_extra or {}).get("chatcli") or {}


def chat(srv: Server, messages: list[dict[str, str]], **kw: Any) -> Reply:
    kw.setdefault("temperature", 0)
    raw = srv.client().chat.completions.with_raw_response.create(
        model="any", messages=messages, max_tokens=MAX_TOKENS, **kw)
    reply = Reply(raw)
    if reply.conv:
        wait_written(srv.conv(reply.conv).path)
    return reply


def chat_stream(srv: Server, messages: list[dict[str, str]]) -> tuple[str, Any, str]:
    text = ""
    usage = None
    with srv.client().chat.completions.with_streaming_response.create(
            model="any", messages=messages, temperature=0, max_tokens=MAX_TOKENS, stream=True,
            stream_options={"include_usage": True}) as resp:
        conv = resp.headers.get("x-chatcli-conversation")
        for chunk in resp.parse():
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage is not None:
                usage = chunk.usage
    if conv:
        wait_written(srv.conv(conv).path)
    return text, usage, conv


def converse(srv: Server, system: str, questions: list[str], *,
             stream: bool = False) -> tuple[list[dict[str, str]], list[Reply | tuple[str, Any, str]]]:
    msgs = [{"role": "system", "content": system}]
    out: list[Any] = []
    if srv.parallel > 1:
        # A new conversation whose replies are compared with the reference's starts once nobody is expected
        # back: a message evaluated while another slot's caller may return goes to the batch context to
        # meet it, and is computed there (not as a single context computes). Its own later turns are not
        # affected (a slot's return is its own).
        time.sleep(_LINGER + 0.2)
    for q in questions:
        msgs.append({"role": "user", "content": q})
        if stream:
            r = chat_stream(srv, msgs)
            text = r[0]
        else:
            r = chat(srv, msgs)
            text = r.text
        out.append(r)
        msgs.append({"role": "assistant", "content": text})
    return msgs, out


QUESTIONS = ["Name a fruit.", "Name a colour.", "Name an animal.", "Name a city."]


def closing_of(m: Any) -> int:
    """Tokens at the end of a served reply the server evaluates with the next prompt, not after the reply: its
    last sampled token and its closing (ChatML's ``<|im_end|>\n``; a reply that ended at its end-of-turn token
    sampled that one, and one cut at a stop string whole tokens: only the closing follows its last)."""
    if m.role != "assistant" or m.stop == "client":
        return 0
    return 2 if m.stop in ("eog", "stop") else 3


def user_span(srv: Server, cid: str, n: int, *, closing: bool = True) -> tuple[int, int]:
    """Token span the request that sent the n-th user message (0-based) of a stored conversation evaluated:
    the message, after the previous reply's end the saved state lacked (``closing``)."""
    r = srv.replay(cid)
    users = [m for m in r.active if m.role == "user"]
    i = r.active.index(users[n])
    before = closing_of(r.active[i - 1]) if closing and i > 0 else 0
    return users[n].p0 - before, users[n].p1


def file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- a conversation -----------------------------------------------------------------------------------


def test_three_turns_reuse_the_whole_history(server: Server) -> None:
    msgs, replies = converse(server, "You are terse. (three turns)", QUESTIONS[:3])
    r1, r2, r3 = replies
    assert isinstance(r3, Reply)
    assert r1.conv == r2.conv == r3.conv
    assert r1.cached == 0
    # The 3rd request evaluated its new message only: everything before it came from memory.
    p0, p1 = user_span(server, r3.conv, 2)
    assert (r3.cached, r3.prompt) == (p0, p1)
    assert r3.ext["evaluated_tokens"] == p1 - p0
    p0, p1 = user_span(server, r2.conv, 1)
    assert (r2.cached, r2.prompt) == (p0, p1)
    # Stored exactly like a REPL turn: the transcript holds the replies the client got.
    r = server.replay(r3.conv)
    assert [m.text for m in r.active] == [m["content"] for m in msgs[1:]]
    assert [m.as_dict() for m in r.persona_messages] == [msgs[0]]
    meta = server.conv(r3.conv).read_meta()
    assert meta["source"] == "api"


def test_streaming_equals_non_streaming(server: Server, reference: Server) -> None:
    system = "You are terse. (streaming)"
    _, plain = converse(server, system, QUESTIONS[:3])
    _, streamed = converse(reference, system, QUESTIONS[:3], stream=True)
    assert [p.text for p in plain] == [s[0] for s in streamed]  # type: ignore[union-attr,index]
    text, usage, conv = streamed[2]  # type: ignore[misc]
    p0, p1 = user_span(reference, conv, 2)
    assert (usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens) == (p0, p1)
    assert reference.replay(conv).active[-1].text == text


# -- restart -----------------------------------------------------------------------------------------


def test_sigkill_restart_evaluates_only_the_new_message(server: Server, reference: Server) -> None:
    system = "You are terse. (restart)"
    msgs, replies = converse(server, system, QUESTIONS[:3])
    cid = replies[-1].conv  # type: ignore[union-attr]
    server.kill()
    server.start()
    msgs.append({"role": "user", "content": QUESTIONS[3]})
    r4 = chat(server, msgs)
    assert r4.conv == cid
    p0, p1 = user_span(server, cid, 3)
    assert (r4.cached, r4.prompt) == (p0, p1)
    assert r4.ext["evaluated_tokens"] == p1 - p0
    # The same conversation on a server that was never restarted gives the same greedy replies.
    _, ref = converse(reference, system, QUESTIONS[:4])
    assert [r.text for r in replies] + [r4.text] == [r.text for r in ref]  # type: ignore[union-attr]


# -- regenerate, edit ---------------------------------------------------------------------------------


def test_regenerate_evaluates_nothing_and_keeps_the_original(server: Server) -> None:
    msgs, replies = converse(server, "You are terse. (regenerate)", QUESTIONS[:2])
    cid = replies[-1].conv  # type: ignore[union-attr]
    from chatcli.core.kv.budget import total_bytes

    before = file_hash(server.conv(cid).transcript_path)
    convs_dir = server.conv(cid).path.parent
    disk_before = total_bytes(convs_dir, None)
    regen = chat(server, msgs[:-1])
    assert regen.ext["evaluated_tokens"] == 0
    assert regen.cached == regen.prompt == user_span(server, cid, 1)[1]
    assert regen.conv != cid and regen.ext["forked_from"] == cid
    assert regen.text == replies[-1].text  # greedy: the same logits, the same reply
    assert file_hash(server.conv(cid).transcript_path) == before
    # The fork shares the parent's state bytes (a hard link): the disk grew by the fork's own small file,
    # whose only sizeable records are the new reply's cells.
    child_state = server.conv(regen.conv).state_path
    [base] = sf.base_files(child_state)
    assert os.path.samefile(base, server.conv(cid).state_path)
    assert total_bytes(convs_dir, None) - disk_before == child_state.stat().st_size
    own = [r for r in sf.scan(child_state).records if r.file is None]
    assert [r.kind for r in own[:3]] == [sf.HEADER, sf.BASE, sf.TRUNCATE]
    assert sum(r.size for r in own if r.kind != sf.CELLS) < 4096
    # Both branches stay reachable: the original history still continues the original conversation.
    nxt = chat(server, [*msgs, {"role": "user", "content": QUESTIONS[2]}])
    assert nxt.conv in (cid, regen.conv)  # identical histories: either may continue
    assert nxt.cached == user_span(server, nxt.conv, 2)[0]


def test_edit_forks_and_the_original_stays_intact(server: Server) -> None:
    system = "You are terse. (edit)"
    msgs, replies = converse(server, system, QUESTIONS[:3])
    cid = replies[-1].conv  # type: ignore[union-attr]
    conv = server.conv(cid)
    before = (file_hash(conv.transcript_path), file_hash(conv.state_path))
    # Edit of message 1: only the persona is shared, so a new conversation (nothing copied: not a fork).
    e1 = chat(server, [msgs[0], {"role": "user", "content": "Name a vegetable."}])
    assert e1.conv != cid and e1.ext["forked_from"] is None and e1.ext["state_from"] == "new"
    assert "forked_from" not in server.conv(e1.conv).read_meta()
    assert e1.cached == len(server.replay(cid).prefix_tokens)
    # Edit of message 2: the first exchange's cells are copied, only the new message is evaluated.
    e2 = chat(server, [*msgs[:3], {"role": "user", "content": "Name a planet."}])
    assert e2.conv not in (cid, e1.conv) and e2.ext["forked_from"] == cid
    assert e2.cached == user_span(server, cid, 1, closing=False)[0]  # the closing is in the parent's state
    assert e2.ext["evaluated_tokens"] == e2.prompt - e2.cached
    assert server.replay(e2.conv).active[0].tokens == server.replay(cid).active[0].tokens
    assert (file_hash(conv.transcript_path), file_hash(conv.state_path)) == before
    # The original continues where it was, as if nothing happened.
    r4 = chat(server, [*msgs, {"role": "user", "content": QUESTIONS[3]}])
    assert r4.conv == cid
    assert r4.cached == user_span(server, cid, 3)[0]


def test_stop_strings_and_seed(server: Server) -> None:
    msgs = [{"role": "system", "content": "You are a poet. (stop and seed)"},
            {"role": "user", "content": "Write a long poem about the sea."}]
    full = chat(server, msgs)
    words = full.text.split()
    assert len(words) > 3
    stop = " " + words[2]
    cut = chat(server, msgs, stop=[stop])
    assert stop not in cut.text and full.text.startswith(cut.text)
    # Stored as the client saw it: resending the cut reply continues that conversation.
    nxt = chat(server, [*msgs, {"role": "assistant", "content": cut.text}, {"role": "user", "content": "More."}])
    assert nxt.conv == cut.conv
    # A seed makes a sampled reply reproducible; regenerating samples again (and forks each time).
    a = chat(server, msgs, temperature=1.0, seed=7)
    b = chat(server, msgs, temperature=1.0, seed=7)
    assert a.text == b.text and a.conv != b.conv
    assert a.ext["evaluated_tokens"] == b.ext["evaluated_tokens"] == 0


def test_a_new_conversation_takes_up_what_it_shares_with_the_context_s_last(tmp_path: Path) -> None:
    """A new conversation in a context that held another one: the persona and the start of its first
    message are taken up from that one's cells, not evaluated (as llama-server reuses a slot's prompt); its
    reply is a fresh server's, and a restart continues it from its saved state."""
    system = {"role": "system", "content": "You are terse. (kept cells)"}
    a = [system, {"role": "user", "content": "Tell me about the old mill by the river and its miller."}]
    b = [system, {"role": "user", "content": "Tell me about the old mill by the sea and its keeper."}]
    srv = Server(tmp_path / "home", api_key=None)
    srv.start()
    try:
        ra = chat(srv, a)
        rb = chat(srv, b)
        assert rb.ext["state_from"] == "new" and rb.conv != ra.conv
        ua = srv.replay(ra.conv).active[0]
        ub = srv.replay(rb.conv).active[0]
        assert ua.p0 == ub.p0 > 0  # after the persona prefix
        shared = next(i for i, (x, y) in enumerate(zip(ua.tokens, ub.tokens, strict=False)) if x != y)
        assert shared >= 5  # the role header and "Tell me about the old mill by the"
        assert rb.cached == ub.p0 + shared  # the persona and the shared start of the message: not evaluated
        assert rb.prompt == ub.p0 + len(ub.tokens)
        b.append({"role": "assistant", "content": rb.text})
        b.append({"role": "user", "content": QUESTIONS[0]})
        srv.kill()
        srv.start()
        nxt = chat(srv, b)  # restored from its state file: only the new message is evaluated
        assert nxt.conv == rb.conv and nxt.cached == user_span(srv, rb.conv, 1)[0]
    finally:
        srv.stop()
    ref = Server(tmp_path / "ref", api_key=None)
    ref.start()
    try:
        fresh = chat(ref, b[:2])  # an empty context: the message evaluated whole
        assert fresh.cached < rb.cached and fresh.text == rb.text
        again = chat(ref, b)
        assert again.text == nxt.text
    finally:
        ref.stop()


def test_shared_fork_equals_a_copied_one(server: Server, tmp_path: Path) -> None:
    """A fork sharing the parent's bytes (hard link + BASE record) holds the same live cells and logits as a
    byte-for-byte copy, at every message boundary; its own file is a few hundred bytes."""
    from chatcli.core.forking import fork_state

    _, replies = converse(server, "You are terse. (fork copy)", QUESTIONS[:2])
    conv = server.conv(replies[-1].conv)  # type: ignore[union-attr]
    r = server.replay(conv.id)
    for k in range(len(r.active)):  # not the last reply's end: its closing waits for the next prompt
        cut = r.active[k - 1].p1 if k else len(r.prefix_tokens)
        (tmp_path / f"a{k}").mkdir()
        (tmp_path / f"b{k}").mkdir()
        a, b = tmp_path / f"a{k}" / "state.kv", tmp_path / f"b{k}" / "state.kv"
        assert fork_state(conv.state_path, a, cut) == fork_state(conv.state_path, b, cut, share=False) == cut
        assert a.stat().st_size < 1024 and len(sf.base_files(a)) == 1 and sf.base_files(b) == []
        ra, rb = sf.scan(a), sf.scan(b)
        assert ra.problem == rb.problem == "" and ra.bases and not rb.bases
        (ca, la, na), (cb, lb, nb) = ra.live(), rb.live()
        assert na == nb == cut and [(c.record.p0, c.end) for c in ca] == [(c.record.p0, c.end) for c in cb]
        assert [sf.read_payload(a, c.record) for c in ca] == [sf.read_payload(b, c.record) for c in cb]
        assert (la is None) == (lb is None)
        if la is not None and lb is not None:
            assert sf.read_payload(a, la) == sf.read_payload(b, lb)


# -- concurrency -----------------------------------------------------------------------------------------


def test_two_clients_at_once_are_stored_as_they_were_sent(server: Server) -> None:
    """Two conversations generating at once are decoded in shared batches (--parallel 2), which llama.cpp
    does not make bit-identical to decoding them one after the other, so their replies are not compared
    with sequential runs; what must hold is that each is stored exactly as sent, resident (nothing
    restored), and that a batched conversation resumes exactly (tests/test_batched_decode.py)."""
    systems = ["You are terse. (client A)", "You are verbose. (client B)"]
    results: dict[str, list[str]] = {}
    convs: dict[str, list[Reply]] = {}
    errors: list[BaseException] = []

    def run(system: str) -> None:
        try:
            _, replies = converse(server, system, QUESTIONS[:3])
            results[system] = [r.text for r in replies]  # type: ignore[union-attr]
            convs[system] = replies  # type: ignore[assignment]
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s,)) for s in systems]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    for system in systems:
        replies = convs[system]
        assert all(r.text for r in replies) and len({r.conv for r in replies}) == 1
        assert [r.ext["state_from"] for r in replies[1:]] == ["memory", "memory"]
        stored = [m.text for m in server.replay(replies[0].conv).active if m.role == "assistant"]
        assert stored == results[system]


def test_resident_conversations_are_not_restored(server: Server, reference: Server) -> None:
    """Two contexts (--parallel 2): switching between two conversations restores nothing; a third
    conversation releases the least recently used one, which then comes back from its state file."""
    a = [{"role": "system", "content": "You are terse. (resident A)"}, {"role": "user", "content": QUESTIONS[0]}]
    b = [{"role": "system", "content": "You are terse. (resident B)"}, {"role": "user", "content": QUESTIONS[0]}]
    c = [{"role": "system", "content": "You are terse. (resident C)"}, {"role": "user", "content": QUESTIONS[0]}]
    seen: dict[str, list[str]] = {"a": [], "b": []}

    def alone(msgs: list[dict[str, str]]) -> Reply:
        # A caller that just ended a reply is expected back for a while (``_LINGER``), and a message evaluated
        # meanwhile goes to the batch context to meet it: computed there, not as a single context computes.
        # Each request here comes once nobody is expected (the previous test's two clients ended together:
        # the next request counts one of them off, the other would still be waited for).
        time.sleep(_LINGER + 0.2)
        return chat(server, msgs)

    def turn(msgs: list[dict[str, str]], name: str) -> Reply:
        r = alone(msgs)
        msgs += [{"role": "assistant", "content": r.text}, {"role": "user", "content": QUESTIONS[len(msgs) // 2]}]
        seen[name].append(r.text)
        return r

    assert turn(a, "a").ext["state_from"] == "new"
    assert turn(b, "b").ext["state_from"] == "new"
    ra = turn(a, "a")
    rb = turn(b, "b")
    assert (ra.ext["state_from"], rb.ext["state_from"]) == ("memory", "memory")
    assert alone(c).ext["state_from"] == "new"  # a was the least recently used: released
    ra = turn(a, "a")
    assert ra.ext["state_from"] == "disk" and ra.cached == user_span(server, ra.conv, 2)[0]
    # Contexts of their own compute exactly what a single context does.
    for name, system in (("a", "You are terse. (resident A)"), ("b", "You are terse. (resident B)")):
        _, ref = converse(reference, system, QUESTIONS[:len(seen[name])])
        assert seen[name] == [r.text for r in ref]  # type: ignore[union-attr]


# -- disconnect ------------------------------------------------------------------------------------------


def eog_ban(model_path: Path) -> dict[str, int]:
    """``logit_bias`` banning the model's end-of-generation tokens: a reply then runs to ``max_tokens``."""
    import llama_cpp

    m = llama_cpp.Llama(model_path=str(model_path), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(m.model)
    return {str(i): -100 for i in range(llama_cpp.llama_vocab_n_tokens(vocab)) if llama_cpp.llama_vocab_is_eog(vocab, i)}


def test_disconnect_mid_stream_records_the_reply_so_far(server: Server, model_path: Path) -> None:
    system = "You are a storyteller. (disconnect)"
    msgs, replies = converse(server, system, ["Name a fruit."])
    cid = replies[0].conv  # type: ignore[union-attr]
    msgs.append({"role": "user", "content": "Tell me a very long story about a dragon."})
    # The end of turn is banned: the reply cannot end by itself before the server sees the client leave,
    # however fast it streams (an unbanned story could finish first: "stop", not "cancelled").
    body = {"model": "any", "messages": msgs, "temperature": 0, "max_tokens": 400, "stream": True,
            "logit_bias": eog_ban(model_path)}
    got = ""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json", **server.auth()})
    resp = conn.getresponse()
    assert resp.status == 200
    while len(got) <= 20:
        line = resp.readline().decode().strip()
        assert line or not resp.isclosed()
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[6:])
            got += chunk["choices"][0]["delta"].get("content") or ""
    conn.sock.shutdown(socket.SHUT_RDWR)  # leave mid-reply
    conn.close()
    # The server records what it produced, like a Ctrl-C'd reply: transcript and state agree.
    deadline = time.monotonic() + 60
    while True:
        r = server.replay(cid)
        if len(r.active) == 4 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    last = r.active[-1]
    assert last.role == "assistant" and last.stop == "cancelled", last
    assert last.text.startswith(got.strip()) and len(last.tokens) < 400
    # The state is written after the transcript (the truth first): under load (fsync behind other IO) it
    # came 0.4-0.9 s later, after the loop above had seen the reply.
    while (res := sf.scan(server.conv(cid).state_path)).live()[2] != last.p1 - closing_of(last) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert res.live()[2] == last.p1 - closing_of(last)  # its closing waits for the next prompt
    # Nothing is lost: resending the history with the recorded reply continues the same conversation.
    msgs.append({"role": "assistant", "content": last.text})
    msgs.append({"role": "user", "content": "Thanks."})
    nxt = chat(server, msgs)
    assert nxt.conv == cid and nxt.cached == last.p1 - closing_of(last)


LONG = "The river runs past the old mill and the orchard, and the miller counts his sacks. " * 95


def _post_and_leave(srv: Server, body: dict[str, Any], after: float) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json", **srv.auth()})
    time.sleep(after)
    return conn


def test_disconnect_while_the_prompt_is_read_stops_between_batches(server: Server) -> None:
    """A client that leaves while its long message is evaluated (several n_batch batches) is noticed before
    the reply starts: the evaluation stops at the next batch and nothing is stored for it (a new
    conversation holding nothing is removed), instead of reading the prompt and generating for nobody."""
    before = server.ids()
    n_logged = server.log.read_text().count("client went away before its reply started")
    body = {"model": "any", "messages": [{"role": "system", "content": "You are terse. (prompt disconnect)"},
                                         {"role": "user", "content": LONG}], "temperature": 0, "max_tokens": 8}
    conn = _post_and_leave(server, body, 0.2)
    assert conn.sock is not None
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.monotonic() + 120
    while server.log.read_text().count("client went away before its reply started") == n_logged:
        assert time.monotonic() < deadline, server.log.read_text()[-2000:]
        time.sleep(0.1)
    assert server.ids() == before  # the prompt was cut before its end: no reply, no conversation
    # The server goes on serving.
    _, replies = converse(server, "You are terse. (after prompt disconnect)", QUESTIONS[:1])
    assert replies[0].generated > 0  # type: ignore[union-attr]


def test_sigterm_while_a_prompt_is_read_answers_503_and_exits_promptly(tmp_path: Path) -> None:
    """Shutting down does not wait for a long prompt and its whole reply: the request stops at the next
    batch, its client is told (503, an OpenAI error), the process exits 0."""
    srv = Server(tmp_path / "term-prompt", api_key=None)
    srv.start()
    try:
        body = {"model": "any", "messages": [{"role": "user", "content": LONG}], "max_tokens": 400}
        conn = _post_and_leave(srv, body, 0.3)
        assert srv.proc is not None
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        resp = conn.getresponse()
        status, err = resp.status, json.loads(resp.read())["error"]
        assert srv.proc.wait(90) == 0
        took = time.monotonic() - t0
        conn.close()
    finally:
        srv.stop()
    assert status == 503 and "shutting down" in err["message"], err
    log = srv.log.read_text()
    assert "Traceback" not in log and "chatcli serve: stopped" in log
    assert took < 30, took  # not the whole prompt and a 400-token reply


def test_sigterm_mid_stream_records_the_reply_and_exits_cleanly(tmp_path: Path) -> None:
    srv = Server(tmp_path / "term", api_key=None)
    srv.start()
    try:
        body = {"model": "any", "messages": [{"role": "user", "content": "Tell me a very long story."}],
                "temperature": 0, "max_tokens": 400, "stream": True}
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        cid = resp.getheader("x-chatcli-conversation")
        got = ""
        while len(got) <= 20:
            line = resp.readline().decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                got += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(90) == 0
        conn.close()
    finally:
        srv.stop()
    assert "Traceback" not in srv.log.read_text()
    r = srv.replay(cid)
    last = r.active[-1]
    assert last.role == "assistant" and last.stop == "cancelled" and last.text.startswith(got.strip())
    assert sf.scan(srv.conv(cid).state_path).live()[2] == last.p1


def test_sigterm_while_starting_exits_cleanly(tmp_path: Path) -> None:
    # The socket listens before the HTTP layer is imported and while the model loads: a SIGTERM there
    # used to kill the process with 143 (no handler yet). Sent the moment the port accepts.
    home = tmp_path / "early"
    home.mkdir()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATCLI_")}
    env.update(CHATCLI_HOME=str(home), PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    log = home / "server.log"
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "chatcli", "serve", "--port", str(port), "--threads", "2"],
                                env=env, stdout=out, stderr=out, cwd=str(home))
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.005)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(90)
    finally:
        stop_process(proc)
    text = log.read_text()
    assert rc == 0 and "Traceback" not in text and "chatcli serve: stopped" in text, (rc, text[-2000:])
    assert "http://127.0.0.1" not in text  # stopped before it served: the banner was never printed


# -- other front ends --------------------------------------------------------------------------------------


def test_api_conversations_in_ls_and_resumable(server: Server) -> None:
    _, replies = converse(server, "You are terse. (ls)", QUESTIONS[:1])
    cid = replies[0].conv  # type: ignore[union-attr]
    env = {**os.environ, "CHATCLI_HOME": str(server.home), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "chatcli", "ls", "--json"], capture_output=True, text=True,
                          env=env, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    rows = {r["id"]: r for r in json.loads(proc.stdout)}
    assert rows[cid]["from"] == "api"
    # Between requests the server holds no lock: another process can take the conversation over.
    conv = server.conv(cid)
    conv.lock()
    conv.unlock()


def test_a_repl_conversation_is_continued_without_reingesting(server: Server) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import drive

    env_home = os.environ.get("CHATCLI_HOME")
    os.environ["CHATCLI_HOME"] = str(server.home)
    try:
        out = drive.run_process("--new", *drive.says(["Hello there."]))
    finally:
        if env_home is not None:
            os.environ["CHATCLI_HOME"] = env_home
    cid = out["id"]
    r = server.replay(cid)
    msgs = [m.as_dict() for m in r.persona_messages] + [{"role": m.role, "content": m.text} for m in r.active]
    msgs.append({"role": "user", "content": "What is your name?"})
    nxt = chat(server, msgs)
    assert nxt.conv == cid
    assert nxt.cached == r.active[-1].p1


# -- context full -------------------------------------------------------------------------------------------


def test_context_full_shifts_like_the_repl_and_is_reported(tmp_path: Path) -> None:
    srv = Server(tmp_path / "small", api_key=None, n_ctx=512)
    srv.start()
    try:
        msgs = [{"role": "system", "content": "You are terse."}]
        shifted = None
        for i in range(8):
            msgs.append({"role": "user", "content": f"Question {i}: " + "tell me about the sea and the sky. " * 10})
            r = chat(srv, msgs)
            msgs.append({"role": "assistant", "content": r.text})
            if r.ext.get("context_shift"):
                shifted = r
                break
        assert shifted is not None, "the context never filled up"
        assert shifted.ext["context_shift"]["messages_dropped"] >= 2
        assert any("context full" in n for n in shifted.ext["notices"])
        cid = shifted.conv
        rp = srv.replay(cid)
        assert rp.out_of_context and len(rp.prefix_tokens) > 0
        assert shifted.prompt == rp.active[-1].p0  # what the model saw: persona + what stayed
        # The client resends everything, dropped messages included: the shifted conversation continues.
        msgs.append({"role": "user", "content": "Thanks."})
        nxt = chat(srv, msgs)
        assert nxt.conv == cid
        user = srv.replay(cid).active[-2]
        assert user.with_closing and nxt.cached == user.p0 - user.with_closing
    finally:
        srv.stop()


# -- bad input ------------------------------------------------------------------------------------------


def post(server: Server, body: bytes | str, headers: dict[str, str] | None = None) -> Resp:
    h = {"Content-Type": "application/json", **server.auth(), **(headers or {})}
    return request(server.port, "POST", "/v1/chat/completions", body, h)


def _msgs(*contents: Any, role: str = "user") -> str:
    return json.dumps({"messages": [{"role": role, "content": c} for c in contents], "max_tokens": 4})


BAD = {
    "malformed json": ('{"messages": [', 400, "invalid_json"),
    "not an object": ("[1, 2]", 400, None),
    "messages not a list": ('{"messages": "hi"}', 400, None),
    "content not a string": (_msgs(5), 400, None),
    "image content part": (_msgs([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]), 400, None),
    "temperature not a number": ('{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', 400, None),
    "stream not a bool": ('{"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}', 400, None),
    "no messages": ('{"messages": []}', 400, None),
    "missing messages": ('{"model": "x"}', 400, None),
    "empty message": (_msgs("   "), 400, None),
    "unknown role": (_msgs("hi", role="wizard"), 400, None),
    "ends with a reply": (_msgs("hi", role="assistant"), 400, None),
    "too long for the context": (_msgs("word " * 3000), 400, "context_length_exceeded"),
    "n > 1": ('{"messages": [{"role": "user", "content": "hi"}], "n": 2}', 400, None),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_a_4xx_with_an_openai_error(server: Server, case: str) -> None:
    body, status, code = BAD[case]
    before = server.ids()
    resp = post(server, body)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error" and "Traceback" not in resp.text
    if code:
        assert err["code"] == code
    assert server.ids() == before  # a refused request changes nothing


def test_authentication_and_limits(server: Server) -> None:
    ok = _msgs("hi")
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong-key-0000000"}, {"Authorization": KEY}):
        resp = post(server, ok, headers)
        assert resp.status_code == 401, resp.text
        assert resp.json()["error"]["code"] == "invalid_api_key"
    assert request(server.port, "GET", "/v1/models").status_code == 401
    # /health answers without the key (probes), but says what the server holds only with it.
    bare = request(server.port, "GET", "/health")
    assert bare.status_code == 200 and bare.json() == {"status": "ok"}
    assert "model" in request(server.port, "GET", "/health", headers=server.auth()).json()
    models = request(server.port, "GET", "/v1/models", headers=server.auth()).json()
    assert models["data"][0]["object"] == "model"
    big = json.dumps({"messages": [{"role": "user", "content": "x" * (9 * 1024 * 1024)}]})
    resp = post(server, big)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
    many = json.dumps({"messages": [{"role": "user", "content": "hi"}] * 3000})
    resp = post(server, many)
    assert resp.status_code == 400 and "too many messages" in resp.json()["error"]["message"]
    resp = request(server.port, "GET", "/v1/nothing", headers=server.auth())
    assert resp.status_code == 404 and resp.json()["error"]["message"]
    resp = post(server, _msgs("hi"), {"X-Chatcli-Conversation": "zzzzzz"})
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "conversation"


def test_models_id_is_the_file_stem_and_requests_naming_it_or_another_are_accepted(server: Server) -> None:
    from chatcli.models.resolve import bundled_model_path

    path = bundled_model_path()
    assert path is not None
    models = request(server.port, "GET", "/v1/models", headers=server.auth()).json()
    [entry] = models["data"]
    assert entry["id"] == path.stem and not any(c.isspace() for c in entry["id"])
    assert " " in entry["name"]  # the GGUF's general.name stays available, for people
    msgs = [{"role": "system", "content": "You are terse. (model id)"}, {"role": "user", "content": "Name a fruit."}]
    for name in (entry["id"], "gpt-4o"):
        comp = server.client().chat.completions.create(model=name, messages=msgs, temperature=0, max_tokens=4)
        assert comp.model == entry["id"] and comp.choices[0].message.content


def test_a_port_in_use_is_one_line_before_the_model_loads(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATCLI_")}
    env.update(CHATCLI_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        # A model that does not exist: had the model been resolved and loaded first, that would be the error.
        for model in ([], ["--model", str(tmp_path / "missing.gguf")]):
            proc = subprocess.run([sys.executable, "-m", "chatcli", "serve", "--port", str(port), *model],
                                  env=env, capture_output=True, text=True, timeout=120)
            assert proc.returncode != 0 and proc.stdout == ""
            lines = proc.stderr.strip().splitlines()
            assert len(lines) == 1 and f"cannot listen on 127.0.0.1:{port}" in lines[0], proc.stderr
            assert "in use" in lines[0] and "Traceback" not in proc.stderr


def test_content_errors_say_what_is_accepted() -> None:
    from chatcli.server.errors import APIError
    from chatcli.server.schemas import parse_chat_request

    for content in (5, [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]):
        with pytest.raises(APIError) as info:
            parse_chat_request({"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": content}]},
                               max_messages=10, header_conversation=None)
        assert info.value.param == "messages.1.content" and "text parts" in info.value.message
        assert ".str" not in info.value.message
    req, _ = parse_chat_request({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
                                max_messages=10, header_conversation=None)
    assert req.messages[0].content == "hi"
