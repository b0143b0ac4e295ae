"""The end of a reply is answered before its state is written, and that costs nothing but time.

``serve`` sends a reply's end (``[DONE]``, or the JSON completion) once the transcript line is written; the
reply's cells, logits and metadata are written after it, while the request still holds its context. So:

- a request right after the end, on the same conversation, waits for that write and continues the
  conversation as recorded (not a fork, nothing restored);
- a server killed between ``[DONE]`` and the state write leaves a conversation that resumes to exactly
  the tokens an uninterrupted server gives (the transcript is the truth; the state file only lags);
- every response carries llama-server's ``timings``, consistent with its ``usage``.

Real model (the bundled SmolLM2), greedy.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chatcli.core.files.store import ConversationDir
from chatcli.core.transcript import replay_events
from chatcli.server.service import ChatRequest, ChatService, Finished, Started
from tests.golden import GUARD, state_tokens, wait_for
from tests.remote_server import free_port, stop_process

BASE_SESSION = {"max_tokens": 16}
ROOT = Path(__file__).resolve().parent.parent
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
TURNS = ["Hi! What is your name?", "What is the capital of France?", "And of Italy?"]
TIMING_KEYS = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
               "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}


def _req(msgs: list[dict[str, str]]) -> ChatRequest:
    from chatcli.core.template import Message

    return ChatRequest(messages=[Message(m["role"], m["content"]) for m in msgs], temperature=0.0, seed=7,
                       max_tokens=16)


def _run(svc: ChatService, msgs: list[dict[str, str]]) -> tuple[Started, Finished]:
    evs = list(svc.complete(_req(msgs)))
    started = next(e for e in evs if isinstance(e, Started))
    return started, next(e for e in evs if isinstance(e, Finished))


# -- in process ---------------------------------------------------------------------------------------------


@pytest.fixture
def two_contexts(sess: Any, tmp_path: Path) -> Iterator[ChatService]:
    """Two contexts: a request for the same conversation then has a free one to fork into instead of waiting."""
    sess.engine.clear()
    svc = ChatService(sess, parallel=2, index_path=tmp_path / "index.json")
    yield svc
    svc.close()


def test_a_request_right_after_the_end_waits_for_the_state_and_continues_the_conversation(
        two_contexts: ChatService, sess: Any) -> None:
    svc = two_contexts
    msgs = [SYSTEM, {"role": "user", "content": TURNS[0]}]
    it = svc.complete(_req(msgs))
    fin = None
    for ev in it:
        if isinstance(ev, Finished):
            fin = ev
            break
    assert fin is not None
    conv_dir = sess.store.dir(fin.conversation)
    r = replay_events(conv_dir.read_transcript().events)
    # The end is answered with the reply in the transcript and not yet in the state file.
    assert r.active[-1].role == "assistant" and r.active[-1].text == fin.text
    want = r.tokens()
    assert state_tokens(conv_dir.state_path) != want

    second: dict[str, Any] = {}

    def next_request() -> None:
        second["events"] = list(svc.complete(_req([*msgs, {"role": "assistant", "content": fin.text},
                                                   {"role": "user", "content": TURNS[1]}])))

    th = threading.Thread(target=next_request)
    th.start()
    th.join(0.5)
    assert th.is_alive(), "the second request did not wait for the first one's state"
    assert state_tokens(conv_dir.state_path) != want
    for _ in it:  # the first request writes its state and gives its context back
        pass
    th.join(GUARD)
    started = next(e for e in second["events"] if isinstance(e, Started))
    done = next(e for e in second["events"] if isinstance(e, Finished))
    # The same conversation, from memory: not a fork, not restored.
    assert (started.conversation, started.forked_from, started.state) == (fin.conversation, None, "memory")
    assert done.evaluated == done.prompt_n  # only the new message was evaluated
    svc.close()
    r2 = replay_events(conv_dir.read_transcript().events)
    assert state_tokens(conv_dir.state_path) == r2.tokens()


def test_a_shutdown_writes_what_was_kept_back(chat_service: ChatService, sess: Any) -> None:
    _s, fin = _run(chat_service, [SYSTEM, {"role": "user", "content": TURNS[0]}])
    chat_service.close()
    conv_dir = sess.store.dir(fin.conversation)
    assert state_tokens(conv_dir.state_path) == replay_events(conv_dir.read_transcript().events).tokens()
    assert conv_dir.read_meta()["turns"] == 1


def _check_timings(t: dict[str, Any], usage: dict[str, Any], evaluated: int) -> None:
    assert set(t) == TIMING_KEYS
    assert t["predicted_n"] == usage["completion_tokens"] > 0
    assert t["cache_n"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert 0 < t["prompt_n"] <= evaluated <= usage["prompt_tokens"]
    assert t["prompt_ms"] > 0 and t["predicted_ms"] > 0
    assert t["prompt_per_second"] == pytest.approx(1000 * t["prompt_n"] / t["prompt_ms"])
    assert t["predicted_per_second"] == pytest.approx(1000 * t["predicted_n"] / t["predicted_ms"])
    assert t["prompt_per_token_ms"] == pytest.approx(t["prompt_ms"] / t["prompt_n"])


def test_responses_carry_llama_server_timings(chat_http: Any) -> None:
    msgs = [SYSTEM, {"role": "user", "content": TURNS[0]}]
    body = {"messages": msgs, "max_tokens": 16, "temperature": 0, "seed": 7}
    doc = chat_http.post("/v1/chat/completions", json=body).json()
    _check_timings(doc["timings"], doc["usage"], doc["chatcli"]["evaluated_tokens"])
    # Streamed, continuing it: on the last chunk before [DONE]; only the new message was evaluated.
    msgs += [{"role": "assistant", "content": doc["choices"][0]["message"]["content"]},
             {"role": "user", "content": TURNS[1]}]
    for include_usage in (True, False):
        with chat_http.stream("POST", "/v1/chat/completions",
                              json={**body, "messages": msgs, "stream": True,
                                    "stream_options": {"include_usage": include_usage}}) as resp:
            events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert [("timings" in c) for c in chunks] == [False] * (len(chunks) - 1) + [True]
        ext = next(c["chatcli"] for c in chunks if "chatcli" in c)
        t = chunks[-1]["timings"]
        assert t["prompt_n"] == ext["evaluated_tokens"]
        if include_usage:
            _check_timings(t, chunks[-1]["usage"], ext["evaluated_tokens"])
        msgs = [*msgs[:-1], {"role": "user", "content": TURNS[1] + " Please."}]  # a fork: the next one is new


# -- a server killed between [DONE] and the state write ----------------------------------------------------


class _Serve:
    def __init__(self, home: Path, flag: Path) -> None:
        self.home, self.flag = home, flag
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("CHATCLI_")}
        env.update(CHATCLI_HOME=str(self.home), CHATCLI_TEST_KILL_FLAG=str(self.flag),
                   PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
        args = [sys.executable, str(ROOT / "tests" / "kill_point.py"), "serve", "--port", str(self.port),
                "--n-ctx", "1024", "--threads", "1", "--max-tokens", "16"]
        with (self.home / "server.log").open("ab") as log:
            self.proc = subprocess.Popen(args, env=env, stdout=log, stderr=log, cwd=str(self.home))
        wait_for(self._up, "the server to start", self.proc)

    def _up(self) -> bool:
        try:
            c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            c.request("GET", "/health")
            return c.getresponse().status == 200
        except OSError:
            return False

    def chat(self, msgs: list[dict[str, str]]) -> tuple[str, str, dict[str, Any], bool]:
        """One streamed greedy request: (conversation, text, chatcli's extension, [DONE] received)."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=GUARD)
        c.request("POST", "/v1/chat/completions", body=json.dumps(
            {"messages": msgs, "max_tokens": 16, "temperature": 0, "seed": 7, "stream": True}).encode(),
            headers={"Content-Type": "application/json"})
        r = c.getresponse()
        assert r.status == 200
        text, ext, done = "", {}, False
        for line in iter(r.readline, b""):
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                done = True
                break
            doc = json.loads(data)
            ext = doc.get("chatcli") or ext
            text += "".join((ch.get("delta") or {}).get("content") or "" for ch in doc.get("choices") or [])
        cid = r.getheader("X-Chatcli-Conversation") or ""
        c.close()
        return cid, text, ext, done

    def stop(self) -> None:
        stop_process(self.proc)

    def conv(self, cid: str) -> ConversationDir:
        return ConversationDir(self.home / "data" / "conversations" / cid)


def test_a_kill_between_done_and_the_state_write_resumes_to_the_same_tokens(tmp_path: Path) -> None:
    killed, ref = _Serve(tmp_path / "killed", tmp_path / "flag"), _Serve(tmp_path / "ref", tmp_path / "no-flag")
    try:
        killed.start()
        ref.start()
        msgs = [SYSTEM, {"role": "user", "content": TURNS[0]}]
        cid, text, _, _ = killed.chat(msgs)
        rid, rtext, _, _ = ref.chat(msgs)
        assert text == rtext
        msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": TURNS[1]}]
        state_before = killed.conv(cid).state_path.stat().st_size
        killed.flag.write_text("armed")
        got: dict[str, Any] = {}
        th = threading.Thread(target=lambda: got.update(r=killed.chat(msgs)))
        th.start()
        wait_for(lambda: killed.flag.read_text() == "reached", "the state write", killed.proc)
        th.join(30)  # the stream ends while the state write waits ([DONE] first); 30 s: the reply is done already
        assert got["r"][0] == cid and got["r"][3], "no [DONE] before the state write"
        killed.flag.write_text("go")
        assert killed.proc is not None and killed.proc.wait(GUARD) == -signal.SIGKILL
        killed.flag.unlink()
        assert killed.conv(cid).state_path.stat().st_size == state_before  # nothing of the turn was written
        _, rtext2, _, _ = ref.chat(msgs)
        assert got["r"][1] == rtext2

        killed.start()
        msgs += [{"role": "assistant", "content": rtext2}, {"role": "user", "content": TURNS[2]}]
        cid3, text3, ext3, done3 = killed.chat(msgs)
        rid3, rtext3, rext3, _ = ref.chat(msgs)
        assert (cid3, rid3) == (cid, rid) and done3
        assert ext3["state_from"] == "disk" and rext3["state_from"] == "memory"
        assert ext3["evaluated_tokens"] > rext3["evaluated_tokens"]  # the lost turn was rebuilt
        assert text3 == rtext3
        # Identical token ids, message by message (the transcripts are the truth).
        killed.stop()
        ref.stop()
        a = replay_events(killed.conv(cid).read_transcript().events)
        b = replay_events(ref.conv(rid).read_transcript().events)
        assert a.tokens() == b.tokens()
        assert state_tokens(killed.conv(cid).state_path) == a.tokens()
    finally:
        killed.stop()
        ref.stop()
