"""The engine's CPU threads on the real model: decodes across contexts never overlap, an adapted thread
count computes exactly what a fixed one does, importing the engine leaves libgomp's waiting alone, and the
workers freed after a reply change no result."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from chatcli.backends import llamacpp, omp
from chatcli.backends.llamacpp import Engine, Sampling

GREEDY = Sampling(temperature=0.0)
PROMPT = "<|im_start|>user\nCount from 1 to 100, separated by commas.<|im_end|>\n<|im_start|>assistant\n1, 2,"


def test_decodes_of_sibling_contexts_never_overlap(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    inside = 0
    most = 0
    guard = threading.Lock()
    real = llamacpp.llama_cpp.llama_decode

    def counting_decode(ctx: object, batch: object) -> int:
        nonlocal inside, most
        with guard:
            inside += 1
            most = max(most, inside)
        time.sleep(0.002)  # widen the window in which a second context's decode could start
        try:
            return int(real(ctx, batch))
        finally:
            with guard:
                inside -= 1

    monkeypatch.setattr(llamacpp.llama_cpp, "llama_decode", counting_decode)
    other = engine.sibling()
    try:
        results: dict[int, list[int]] = {}

        def run(i: int, eng: Engine) -> None:
            eng.clear()
            eng.eval(eng.tokenize(PROMPT))
            results[i] = [ev.token for ev in eng.generate(GREEDY, seed=0, max_tokens=16)]

        threads = [threading.Thread(target=run, args=(i, e)) for i, e in enumerate((engine, other))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        other.close()
    assert most == 1
    assert results[0] == results[1] and len(results[0]) == 16  # serialized, not changed


class Alternating:
    """A FreeCores stand-in that changes its answer at every decode: 1, 2, 1, 2..."""

    adaptive = True

    def __init__(self) -> None:
        self.calls = 0

    def threads(self) -> int:
        self.calls += 1
        return 1 + self.calls % 2


def test_changing_the_thread_count_between_decodes_keeps_logits_bit_identical(model_path: Path) -> None:
    fixed = Engine(model_path, n_ctx=1024, n_threads=2)
    adapting = Engine(model_path, n_ctx=1024)
    alt = Alternating()
    adapting._free_cores = alt  # type: ignore[assignment]
    try:
        tokens = fixed.tokenize(PROMPT * 6)
        logits = []
        for eng in (fixed, adapting):
            got = []
            eng.eval(tokens[:40])
            got.append(eng.logits().copy())
            for tok in tokens[40:72]:
                eng.eval([tok])
                got.append(eng.logits().copy())
            logits.append(np.array(got))
        assert alt.calls == 33
        assert np.array_equal(logits[0], logits[1])
    finally:
        fixed.close()
        adapting.close()


def test_importing_the_engine_sets_no_openmp_waiting_policy() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = ("import os, chatcli.backends.llamacpp; "
            "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["None", "None"], out.stderr
    env["OMP_WAIT_POLICY"] = "PASSIVE"  # the user's choice is theirs
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["PASSIVE", "None"], out.stderr


def _native_threads() -> set[int]:
    """This process's OS threads that are not Python threads (libgomp's workers among them)."""
    python = {t.native_id for t in threading.enumerate()}
    return {int(tid) for tid in os.listdir("/proc/self/task")} - python


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc")
def test_decodes_from_many_threads_share_one_openmp_pool(model_path: Path) -> None:
    """libgomp gives every thread that decodes a pool of workers of its own; once they outnumber the CPUs,
    every barrier of every decode sleeps instead of spinning (compute.py). Two threads, alive together,
    each decoding with two CPU threads, must leave one pool: one new worker, not one per thread."""
    eng = Engine(str(model_path), n_ctx=512, n_threads=2)
    try:
        eng.eval(eng.tokenize(PROMPT))  # the pool of whichever thread decodes, made before we count
        before = _native_threads()
        ran_on: set[int] = set()
        real = llamacpp.llama_cpp.llama_decode
        release = threading.Event()

        def recording_decode(ctx: object, batch: object) -> int:
            ran_on.add(threading.get_ident())
            return int(real(ctx, batch))

        def decode_and_wait(tok: int, decoded: threading.Event) -> None:
            eng._decode([tok], last_logits=True)
            decoded.set()
            release.wait(30)  # stay alive: a pool lives as long as its thread

        llamacpp.llama_cpp.llama_decode = recording_decode
        threads: list[threading.Thread] = []
        try:
            for tok in (11, 12):  # one after the other: the engine's token list is not for two writers
                decoded = threading.Event()
                threads.append(threading.Thread(target=decode_and_wait, args=(tok, decoded)))
                threads[-1].start()
                assert decoded.wait(60)
            new = _native_threads() - before
        finally:
            llamacpp.llama_cpp.llama_decode = real
            release.set()
            for t in threads:
                t.join()
        assert len(new) == 0, f"{len(new)} new native threads: a pool per decoding thread"
        assert len(ran_on) == 1 and threading.get_ident() not in ran_on
    finally:
        eng.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc and the build's libgomp")
def test_a_finished_reply_lets_the_openmp_workers_go_and_changes_no_result(
    model_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a reply's last token libgomp's workers spin ~10 ms on a core that the reply's aftermath needs
    (omp.py): generate ends by freeing them. The next decode starts new ones and computes the same logits,
    bit for bit, as a context whose workers never left."""
    assert omp.runtime_found()  # this build's CPU backend uses OpenMP: without it the test would prove nothing
    eng = Engine(str(model_path), n_ctx=1024, n_threads=2)
    try:
        runs: list[tuple[list[int], np.ndarray]] = []
        for keep_workers in (False, True):
            if keep_workers:
                monkeypatch.setattr(omp, "rest", lambda: None)
            eng.clear()
            eng.eval(eng.tokenize(PROMPT))
            with_pool = _native_threads()
            tokens = [ev.token for ev in eng.generate(GREEDY, seed=1, max_tokens=10)]
            deadline = time.monotonic() + 10
            while not keep_workers and _native_threads() >= with_pool and time.monotonic() < deadline:
                time.sleep(0.01)  # a released worker exits on its own schedule
            if keep_workers:
                assert _native_threads() >= with_pool
            else:
                assert not (_native_threads() >= with_pool), "the OpenMP workers outlived the reply"
            tokens += [ev.token for ev in eng.generate(GREEDY, seed=1, max_tokens=10)]
            runs.append((tokens, eng.logits()))
        assert len(runs[0][0]) == 20 and runs[0][0] == runs[1][0]
        assert np.array_equal(runs[0][1], runs[1][1])
    finally:
        eng.close()


def test_a_reply_alone_on_its_model_decodes_on_its_own_thread_and_computes_the_same(
    model_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With no sibling context (``talk``, ``serve --parallel 1``) a reply's tokens are decoded on the thread
    that generates it (compute.py, ``borrowed``): no hop per token. The tokens and the logits after them are
    bit for bit those of the same reply decoded on the compute thread, as it is once the model is shared."""
    from chatcli.backends.compute import COMPUTE

    eng = Engine(str(model_path), n_ctx=1024, n_threads=2)
    try:
        real = llamacpp.llama_cpp.llama_decode
        ran_on: list[int] = []

        def recording_decode(ctx: object, batch: object) -> int:
            ran_on.append(threading.get_ident())
            return int(real(ctx, batch))

        monkeypatch.setattr(llamacpp.llama_cpp, "llama_decode", recording_decode)
        runs: list[tuple[list[int], np.ndarray, set[int]]] = []
        for shared in (False, True):
            other = eng.sibling() if shared else None  # its decodes may come from another thread now
            try:
                assert eng._shared == shared and (other is None or other._shared)
                eng.clear()
                eng.eval(eng.tokenize(PROMPT))
                ran_on.clear()
                tokens = [ev.token for ev in eng.generate(GREEDY, seed=1, max_tokens=12)]
                runs.append((tokens, eng.logits(), set(ran_on)))
            finally:
                if other is not None:
                    other.close()
        assert runs[0][2] == {threading.get_ident()}
        assert runs[1][2] == {COMPUTE._ident} and COMPUTE._ident != threading.get_ident()
        assert len(runs[0][0]) == 12 and runs[0][0] == runs[1][0]
        assert np.array_equal(runs[0][1], runs[1][1])
        # Its sibling closed, the engine is alone on the model again: its replies decode on their thread.
        assert not eng._shared
        ran_on.clear()
        list(eng.generate(GREEDY, seed=1, max_tokens=3))
        assert set(ran_on) == {threading.get_ident()}
    finally:
        eng.close()
