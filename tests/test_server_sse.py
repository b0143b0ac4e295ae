"""The streamed path of ``chatcli serve`` without a model: ``server.bridge`` (the worker thread's hand-off to
the event loop) and ``server.sse`` (the chunks as bytes), over a fake service."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("starlette")

from starlette.testclient import TestClient

from chatcli.server.app import create_app
from chatcli.server.bridge import END, WINDOW, Run
from chatcli.server.service import ChatRequest, Delta, Finished, Started
from chatcli.server.sse import ChunkEncoder, event

pytestmark = pytest.mark.fast


class FakeService:
    """What the app and ``Run`` use of a ``ChatService``; ``complete`` plays back ``script``."""

    parallel = 1
    model_id = "fake-model"
    model_name = "Fake"
    index: tuple[object, ...] = ()  # len() of it: conversations indexed

    def __init__(self, script: Callable[[], Iterator[object]]) -> None:
        self.script = script

    def complete(self, req: ChatRequest, *, cancelled: Callable[[], bool] = lambda: False) -> Iterator[object]:
        return self.script()


def finished(text: str, n: int) -> Finished:
    return Finished("conv1", None, text, "length", 10, 10, n, [], 0, "new")


def run_events(script: Callable[[], Iterator[object]], consume: Callable[[Run], Any]) -> Any:
    async def main() -> Any:
        run = Run(FakeService(script), ChatRequest(messages=[]), set())  # type: ignore[arg-type]
        return await consume(run)
    return asyncio.run(main())


def test_every_event_arrives_once_in_order_whatever_the_timing() -> None:
    """Many events from the worker, a consumer that takes them at random moments, with and without a
    window: nothing lost, nothing twice, END last (the lock-free hand-off's ordering argument)."""
    n = 3000

    def script() -> Iterator[object]:
        for i in range(n):
            if i % 97 == 0:
                time.sleep(0.001)
            yield Delta(str(i)) if i % 500 else Started("c", None, 1, 1)

    async def consume(run: Run) -> list[object]:
        got: list[object] = []
        rnd = random.Random(7)
        while not got or got[-1] is not END:
            got += await run.take(5.0, window=rnd.choice([0.0, 0.0005, 0.002]))
            if rnd.random() < 0.3:
                await asyncio.sleep(0)
        return got

    got = run_events(script, consume)
    assert got[-1] is END and len(got) == n + 1
    assert [getattr(e, "text", "S") for e in got[:-1]] == [str(i) if i % 500 else "S" for i in range(n)]


def test_tokens_are_batched_so_the_loop_is_woken_far_less_than_once_a_token() -> None:
    """Tokens every 2 ms, read as a stream reads them (a window after the first): a wake-up per token would
    be ~60; batched, a 50 ms window gathers ~25 tokens each."""
    n = 60

    def script() -> Iterator[object]:
        yield Started("c", None, 1, 1)
        for i in range(n):
            time.sleep(0.002)
            yield Delta(f" {i}")
        yield finished("", n)

    async def consume(run: Run) -> tuple[int, list[int]]:
        sizes: list[int] = []
        window = 0.0
        while True:
            evs = await run.take(5.0, window=window)
            deltas = [e for e in evs if isinstance(e, Delta)]
            if deltas:
                sizes.append(len(deltas))
                window = WINDOW
            if evs and evs[-1] is END:
                return run.wakeups, sizes

    wakeups, sizes = run_events(script, consume)
    assert sum(sizes) == n
    assert wakeups < n / 3, (wakeups, sizes)
    assert max(sizes) > 1


def test_the_end_of_a_reply_ends_the_window_at_once() -> None:
    """Only text waits for the window: the final event (recorded reply, [DONE]) is taken as it arrives."""
    def script() -> Iterator[object]:
        yield Delta("a")
        time.sleep(0.05)
        yield finished("a", 1)

    async def consume(run: Run) -> tuple[float, list[object]]:
        first = await run.take(5.0)
        t0 = time.perf_counter()
        rest = await run.take(5.0, window=30.0)  # were the end to wait for the window, this took 30 s
        while rest[-1] is not END:
            rest += await run.take(5.0)
        return time.perf_counter() - t0, first + rest

    took, got = run_events(script, consume)
    assert took < 10, took
    assert [type(e).__name__ for e in got[:2]] == ["Delta", "Finished"] and got[-1] is END


@pytest.mark.parametrize("text", ["plain", 'quote " and \\ backslash', "line\nbreak\t", "émoji 🙂 中文", "", "\u2028"])
def test_a_delta_chunk_is_the_bytes_of_the_whole_chunk_encoded(text: str) -> None:
    enc = ChunkEncoder("chatcmpl-1", 123, "model-x")
    assert enc.delta(text) == enc.chunk({"content": text})
    assert enc.delta(text, reasoning=True) == enc.chunk({"reasoning_content": text})
    doc = json.loads(enc.delta(text)[len(b"data: "):])
    assert doc["choices"][0]["delta"] == {"content": text} and doc["model"] == "model-x"


def test_a_model_name_holding_the_split_mark_is_encoded_whole() -> None:
    from chatcli.server import sse

    enc = ChunkEncoder("r", 1, f"odd{sse._MARK}name")
    assert enc.delta("x") == enc.chunk({"content": "x"})


def test_the_bytes_are_sse_starlettes() -> None:
    """The stream writes what sse-starlette wrote before it left the hot path."""
    sse_starlette = pytest.importorskip("sse_starlette.event")
    doc = {"id": "r", "choices": [{"delta": {"content": "hé\n"}}]}
    assert event(doc) == sse_starlette.ServerSentEvent(data=json.dumps(doc, ensure_ascii=False)).encode()


def test_a_streamed_completion_over_http() -> None:
    def script() -> Iterator[object]:
        yield Started("conv1", None, 10, 10)
        for t in ("Hel", "lo", " there"):
            yield Delta(t)
        yield finished("Hello there", 3)

    with TestClient(create_app(FakeService(script))) as http:  # type: ignore[arg-type]
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "stream": True,
                                                    "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert r.headers["cache-control"] == "no-store" and r.headers["x-accel-buffering"] == "no"
    assert r.headers["x-chatcli-conversation"] == "conv1"
    events = [ln[len("data: "):] for ln in r.text.split("\r\n") if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    docs = [json.loads(e) for e in events[:-1]]
    assert docs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(d["choices"][0]["delta"].get("content", "") for d in docs if d["choices"]) == "Hello there"
    assert docs[-2]["choices"][0]["finish_reason"] == "length" and docs[-2]["chatcli"]["conversation"] == "conv1"
    assert docs[-1]["choices"] == [] and docs[-1]["usage"]["completion_tokens"] == 3
    assert len({d["id"] for d in docs}) == 1


def test_a_non_streamed_reply_wakes_the_loop_for_its_first_token_and_its_end_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The text of a non-streamed reply comes whole with ``Finished``: the tokens between must not wake the
    event loop (before, each one did: a wake-up per token, ~60 here)."""
    from chatcli.server import routes

    n, runs = 60, []

    def script() -> Iterator[object]:
        yield Started("conv1", None, 10, 10)
        for i in range(n):
            time.sleep(0.002)
            yield Delta(f" {i}")
        yield finished("".join(f" {i}" for i in range(n)), n)

    class Recorded(Run):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            runs.append(self)

    monkeypatch.setattr(routes, "Run", Recorded)
    with TestClient(create_app(FakeService(script))) as http:  # type: ignore[arg-type]
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "".join(f" {i}" for i in range(n))
    assert r.json()["chatcli"]["conversation"] == "conv1"
    assert len(runs) == 1 and runs[0].wakeups <= 4, runs[0].wakeups
