"""Drive conversations through the core API, in-process or as a separate process.

Used by state tests to prove that a conversation continued in a *new process* behaves exactly like the
uninterrupted one. As a script it prints one JSON object and writes the logits it saw to an .npy file.

    python tests/drive.py --new|--resume ID --say "hi" --say "more" [--temperature T --seed S] --logits out.npy
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chatcli.config.settings import get_paths, load_settings_explicit
from chatcli.core import steps
from chatcli.core.conversation import Conversation
from chatcli.core.events import ReplyEnd, ResumeReport
from chatcli.models.resolve import resolve_model
from chatcli.session import Session


def build_session(*, temperature: float = 0.0, seed: int | None = 1234, n_ctx: int = 2048, model: str | None = None,
                  reserve: int = 64, max_tokens: int = 48, persona: str = "alice", threads: int = 2,
                  kv_type: str | None = None) -> Session:
    flags = {"temperature": temperature, "seed": seed, "n_ctx": n_ctx, "reserve": reserve, "max_tokens": max_tokens,
             "persona": persona, "threads": threads, "model": model, "kv_type": kv_type}
    settings, explicit = load_settings_explicit(flags, paths=get_paths())
    return Session.build(settings, get_paths(), model=resolve_model(model), explicit=explicit)


def isolated_session(home: Path, **kw: Any) -> Session:
    """A session built with no CHATCLI_* variable but CHATCLI_HOME=home (a module's shared model load)."""
    import os

    import pytest

    with pytest.MonkeyPatch.context() as mp:
        for var in [v for v in os.environ if v.startswith("CHATCLI_")]:
            mp.delenv(var)
        mp.setenv("CHATCLI_HOME", str(home))
        return build_session(**kw)


def rebind(session: Session) -> Session:
    """``session`` (its engine) bound to the current CHATCLI_HOME: a test's own store on a shared model load."""
    import dataclasses

    from chatcli.core.files.store import ConversationStore

    paths = get_paths()
    paths.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    return dataclasses.replace(session, paths=paths, store=ConversationStore(paths.conversations_dir))


def drain(gen: Any) -> tuple[Conversation | None, ResumeReport | None, list[ReplyEnd]]:
    """Run an opening or an operation's events to the end: (conversation, resume report, reply ends); the
    first two are None for an operation."""
    done = steps.drain(gen)
    return done.conversation, done.report, done.ends


def say(conv: Conversation, text: str) -> tuple[list[int], np.ndarray]:
    """Send one message; returns the reply's tokens and the logits the reply was sampled from."""
    _, _, ends = drain(conv.send(text))
    assert conv.turn_logits is not None
    return ends[-1].message.tokens, conv.turn_logits[1].copy()


def run_process(*args: str, logits: Path | None = None, timeout: float = 900) -> dict[str, Any]:
    """Run this script in a new process (the current CHATCLI_HOME) and return its JSON result."""
    import os
    import subprocess

    cmd = [sys.executable, __file__, *args] + (["--logits", str(logits)] if logits else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy(), timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def says(msgs: list[str]) -> list[str]:
    """``--say`` arguments for messages."""
    return [a for m in msgs for a in ("--say", m)]


def main() -> None:
    ap = argparse.ArgumentParser()
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--new", action="store_true")
    g.add_argument("--resume")
    ap.add_argument("--say", action="append", default=[])
    ap.add_argument("--regen", action="store_true")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--model")
    ap.add_argument("--logits")
    ap.add_argument("--kv-type")
    a = ap.parse_args()
    session = build_session(temperature=a.temperature, seed=a.seed, n_ctx=a.n_ctx, max_tokens=a.max_tokens, model=a.model,
                            kv_type=a.kv_type)
    out: dict[str, Any] = {"replies": []}
    if a.new:
        conv, _, _ = drain(session.new_conversation("alice"))
    else:
        conv, report, _ = drain(session.open_conversation(a.resume))
        assert report is not None
        out["report"] = report.__dict__
    assert conv is not None
    out["evaluated_after_open"] = session.engine.n_evaluated_total
    logits = []
    if a.regen:
        _, _, ends = drain(conv.regen())
        out["replies"].append(ends[-1].message.tokens)
        out["regen_stats"] = {"reevaluated": ends[-1].stats.reevaluated, "dropped": ends[-1].stats.dropped}
    for text in a.say:
        toks, lg = say(conv, text)
        out["replies"].append(toks)
        logits.append(lg)
    out["id"] = conv.id
    out["tokens"] = list(conv.engine.tokens)
    conv.close()
    if a.logits and logits:
        np.save(a.logits, np.stack(logits))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
