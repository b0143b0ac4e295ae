"""Fault injection: SIGKILL a real ``chatcli talk`` at many points, resume it, and check what survived.

Every kill point runs a fresh ``chatcli talk`` (own CHATCLI_HOME, greedy decoding) over one scripted session
that exercises every write path: turns, ``/undo`` (after which the next turn compacts the state file, and a
second ``/undo`` cuts into the compacted snapshot), long messages that force a context shift (``--n-ctx 512
--reserve 64``). The process is killed with SIGKILL, either

- precisely, by a launcher (``--child`` mode of this file) that runs chatcli's own CLI entry point with a
  few standard-library calls wrapped: the Nth ``os.write`` to the transcript / state file / temp file of an
  atomic rewrite (before it, half-way through it -- a torn write -- or after it), the Nth ``os.replace``,
  the Nth llama decode (i.e. while a reply streams) or a context shift; no hook lives in chatcli itself;
- or by the clock, after a random delay, on the installed ``chatcli`` executable with nothing wrapped.

Then ``chatcli resume ID`` is piped the rest of the script, and the checks are:

1. the conversation opens (exit code 0, "resumed ..." on stderr);
2. every turn whose reply was shown *completely* before the kill (its stats line was printed) is in the
   transcript, and what the transcript holds is a prefix of the uninterrupted run's transcript;
3. at most the in-flight reply is lost ("turns lost beyond the in-flight one" must be 0);
4. where the state file was intact (resume re-evaluated 0 tokens) the continued conversation equals the
   uninterrupted one exactly (greedy decoding, same tokens);
5. afterwards the folder is consistent: the state file scans clean and its live cells hold exactly the
   transcript's tokens, the transcript reads without problems, no temp file is left behind.

Usage::

    python bench/faults.py                 # 64 kill points (stratified), prints counts, exit 1 on any failure
    python bench/faults.py --all           # every precise kill point (219) plus --timed timed ones
    python bench/faults.py --points 10 -v  # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

N_CTX = 512
RESERVE = 64
MAX_TOKENS = 16
THREADS = 1
SEED = 4242

_NOTES = [
    "Here is a note about my garden. The tomatoes grew tall this summer, the beans climbed the fence, the roses "
    "bloomed twice, and the old apple tree gave more fruit than ever before. My neighbour helped me build a small "
    "greenhouse from recycled windows, and we planted herbs, lettuce and peppers inside it. In autumn we collected "
    "seeds, dried them on paper towels and stored them in labelled envelopes for next year. Please tell me in one "
    "sentence what grew in the garden.",
    "Now a note about my trip. We took the early train to the coast, walked along the cliffs for three hours, "
    "watched seals resting on the rocks below, ate fish and chips in a tiny harbour cafe, and then visited a "
    "lighthouse museum where an old keeper told stories about storms and shipwrecks. On the way back the train was "
    "late, so we played cards and read books until we reached the city at midnight. Please tell me in one sentence "
    "where we went.",
    "Finally a note about my kitchen. I painted the walls a soft yellow, replaced the old cupboard doors with pale "
    "oak ones, hung copper pans above the stove, put a row of plants on the window sill and found a round wooden "
    "table at a market. Every Sunday my family now gathers there for a long breakfast of pancakes, fruit, eggs and "
    "fresh coffee while the radio plays quietly. Please tell me in one sentence what colour the walls are.",
    "One more note, about my bicycle. Last spring I bought an old steel bicycle at a flea market, took it apart in "
    "the shed, cleaned every bearing, replaced the chain, the brake pads and both tyres, painted the frame dark "
    "green and fitted a wicker basket to the handlebars. Now I ride it to work along the canal every morning and "
    "it has not broken down once. Please tell me in one sentence what colour the frame is.",
]

# The session every kill point replays. /undo right after a long turn keeps its cells (/redo can still bring
# them back); the short question after it clears the redo stack, so the long turn's cells are dead and
# outweigh the live ones: the state file is compacted (one snapshot). The /undo of that question cuts into the
# snapshot (the part cut is saved as a SPARE record first). The fourth long note fills the 512-token
# context, so the short message after it makes the oldest exchange leave the context (a shift, then a
# snapshot).
SHORT_QUESTION = "What is the capital of France?"
SCRIPT: list[str] = [_NOTES[0], "/undo", SHORT_QUESTION, "/undo", _NOTES[1], _NOTES[2], _NOTES[3],
                     "Thanks! What is two plus two?", "And what is the capital of Italy?"]


def talk_flags() -> list[str]:
    return ["--temperature", "0", "--seed", str(SEED), "--n-ctx", str(N_CTX), "--reserve", str(RESERVE),
            "--max-tokens", str(MAX_TOKENS), "--threads", str(THREADS), "--plain"]


def resume_flags() -> list[str]:
    return ["--temperature", "0", "--reserve", str(RESERVE), "--max-tokens", str(MAX_TOKENS),
            "--threads", str(THREADS), "--plain"]


def chatcli_exe() -> list[str]:
    exe = Path(sys.executable).parent / "chatcli"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "chatcli"]


# ================================================================================= the child (in-process hooks)


def _fd_kind(fd: int) -> str | None:
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    name = os.path.basename(path)
    if name == "transcript.jsonl":
        return "transcript"
    if name == "state.kv":
        return "state"
    if name.startswith(".state.kv.") and name.endswith(".tmp"):
        return "state_tmp"
    if name.startswith(".meta.json.") and name.endswith(".tmp"):
        return "meta_tmp"
    if "/cache/" in path and name.endswith(".tmp"):
        return "cache_tmp"
    return None


def _path_kind(path: Any) -> str | None:
    name = os.path.basename(os.fspath(path))
    return {"state.kv": "state", "meta.json": "meta"}.get(name)


def _install_hooks(spec: dict[str, Any] | None, trace_path: str | None) -> None:
    """Wrap os.write / os.replace / Engine._decode / Engine.shift: count them, SIGKILL at the chosen one."""
    import chatcli.backends.llamacpp as engine_mod

    counts: dict[str, int] = {}
    trace: list[str] = []

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def tick(event: str) -> int:
        counts[event] = counts.get(event, 0) + 1
        if trace_path is not None:
            trace.append(event)
        return counts[event]

    def hit(event: str, n: int, phase: str) -> bool:
        return spec is not None and spec["event"] == event and spec["n"] == n and spec["phase"] == phase

    real_write, real_replace = os.write, os.replace

    def write(fd: int, data: Any) -> int:
        kind = _fd_kind(fd)
        if kind is None:
            return real_write(fd, data)
        ev = f"write:{kind}"
        n = tick(ev)
        if kind == "transcript" and trace_path is not None:
            try:  # what kind of record this is, for readable kill point names
                rec = json.loads(bytes(data))
                trace.append(f"note:{rec.get('type')}:{rec.get('role', rec.get('reason', ''))}")
            except ValueError:
                pass
        if hit(ev, n, "before"):
            die()
        if hit(ev, n, "torn"):
            raw = bytes(data)
            real_write(fd, raw[: max(1, len(raw) // 2)])
            die()
        out = real_write(fd, data)
        if hit(ev, n, "after"):
            die()
        return out

    def replace(src: Any, dst: Any, *a: Any, **kw: Any) -> None:
        kind = _path_kind(dst)
        if kind is None:
            return real_replace(src, dst, *a, **kw)
        ev = f"replace:{kind}"
        n = tick(ev)
        if hit(ev, n, "before"):
            die()
        real_replace(src, dst, *a, **kw)
        if hit(ev, n, "after"):
            die()

    real_decode, real_shift = engine_mod.Engine._decode, engine_mod.Engine.shift

    def decode(self: Any, part: list[int], **kw: Any) -> None:
        n = tick("decode")
        if hit("decode", n, "before"):
            die()
        return real_decode(self, part, **kw)

    def shift(self: Any, keep: int, drop: int) -> None:
        n = tick("shift")
        if hit("shift", n, "before"):
            die()
        real_shift(self, keep, drop)
        if hit("shift", n, "after"):
            die()

    os.write, os.replace = write, replace  # type: ignore[assignment]
    engine_mod.Engine._decode = decode  # type: ignore[method-assign]
    engine_mod.Engine.shift = shift  # type: ignore[method-assign]
    if trace_path is not None:
        import atexit

        atexit.register(lambda: Path(trace_path).write_text(json.dumps(trace)))


def child_main(argv: list[str]) -> None:
    spec = json.loads(os.environ.get("CHATCLI_FAULT") or "null")
    _install_hooks(spec, os.environ.get("CHATCLI_FAULT_TRACE"))
    sys.argv = ["chatcli", *argv]
    from chatcli.cli.app import main

    main()


# ================================================================================= the parent (runs and checks)


@dataclass
class KillPoint:
    label: str
    spec: dict[str, Any] | None = None  # precise: {"event", "n", "phase"}
    delay: float | None = None  # timed: seconds after start


@dataclass
class Run:
    rc: int
    stdout: str
    stderr: str
    seconds: float


@dataclass
class Reference:
    events: list[dict[str, Any]]  # the transcript's events after the prefix, normalised
    line_spans: list[tuple[int, int]]  # per script line: its events [start, end)
    trace: list[str]
    seconds: float


@dataclass
class Outcome:
    point: KillPoint
    killed: bool = False
    completed: int = 0  # replies shown completely before the kill
    lost: int = 0  # completed turns missing afterwards (must be 0)
    opened: bool = True
    intact: bool = False  # resume restored everything from the state file
    identical: bool = False  # final transcript == the uninterrupted one (ignoring alternative indexes)
    alt_mislabelled: bool = False  # ... but a reply got another alternative index than uninterrupted
    problems: list[str] = field(default_factory=list)
    resume_stderr: str = ""  # what the resume printed (its notices: what /redo or /alt evaluated)

    @property
    def ok(self) -> bool:
        return not self.problems


def child_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATCLI_")}
    user_home = home / "user-home"
    user_home.mkdir(parents=True, exist_ok=True)
    env.update(CHATCLI_HOME=str(home), HOME=str(user_home), NO_COLOR="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_talk(home: Path, script: list[str], point: KillPoint | None, trace: Path | None = None,
             timeout: float = 900) -> Run:
    """One `chatcli talk` over the script; killed at ``point`` (None: runs to the end)."""
    env = child_env(home)
    if point is not None and point.delay is not None:
        cmd = [*chatcli_exe(), "talk", *talk_flags()]
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "talk", *talk_flags()]
        if point is not None:
            env["CHATCLI_FAULT"] = json.dumps(point.spec)
        if trace is not None:
            env["CHATCLI_FAULT_TRACE"] = str(trace)
    out, err = home / "talk.out", home / "talk.err"
    t0 = time.monotonic()
    with out.open("wb") as fo, err.open("wb") as fe:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=fo, stderr=fe, env=env, cwd=str(home))
        assert proc.stdin is not None
        try:
            proc.stdin.write("".join(line + "\n" for line in script).encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        if point is not None and point.delay is not None:
            try:
                proc.wait(timeout=point.delay)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    return Run(rc, out.read_text("utf-8", "replace"), err.read_text("utf-8", "replace"), time.monotonic() - t0)


def run_resume(home: Path, conv_id: str, lines: list[str], timeout: float = 900) -> Run:
    t0 = time.monotonic()
    proc = subprocess.run([*chatcli_exe(), "resume", conv_id, *resume_flags()], input="".join(line + "\n" for line in lines),
                          capture_output=True, text=True, env=child_env(home), cwd=str(home), timeout=timeout)
    return Run(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - t0)


def conversation_dirs(home: Path) -> list[Path]:
    root = home / "data" / "conversations"
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


_VOLATILE = ("ts", "v")


def normalised_events(conv: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The transcript's events after the prefix, without timestamps; and the problems reading it."""
    from chatcli.core.files.store import ConversationDir

    tr = ConversationDir(conv).read_transcript()
    evs = [{k: v for k, v in e.items() if k not in _VOLATILE} for e in tr.events if e.get("type") != "prefix"]
    return evs, tr.problems


def completed_replies(stderr: str) -> int:
    """Replies whose stats line was printed: printed only after the turn was saved."""
    return sum(1 for line in stderr.splitlines() if "tok evaluated" in line and "ttft" in line)


def spans_of(events: list[dict[str, Any]], script: list[str]) -> list[tuple[int, int]]:
    """Which events each script line produced (a message: [shift], user, assistant; /undo: truncate; /redo:
    an activate per message brought back)."""
    spans = []
    i = 0
    for line in script:
        start = i
        if line.startswith("/undo"):
            assert events[i]["type"] == "truncate", events[i]
            i += 1
        elif line.startswith("/redo"):
            assert events[i]["type"] == "activate" and events[i].get("redo"), events[i]
            i += 1
            while i < len(events) and events[i]["type"] == "activate" and not events[i].get("redo"):
                i += 1
        else:
            if events[i]["type"] == "shift":
                i += 1
            assert events[i]["type"] == "message" and events[i]["role"] == "user", events[i]
            assert events[i + 1]["type"] == "message" and events[i + 1]["role"] == "assistant", events[i + 1]
            i += 2
        spans.append((start, i))
    assert i == len(events), "the reference transcript has events no script line explains"
    return spans


def reference(workdir: Path, script: list[str] = SCRIPT, *, shift: bool = True) -> Reference:
    """The uninterrupted session (with the hook launcher in counting mode); ``shift``: it must have a context
    shift (the script is meant to fill the context)."""
    home = workdir / "reference"
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    trace_file = home / "trace.json"
    run = run_talk(home, script, None, trace=trace_file)
    if run.rc != 0:
        raise RuntimeError(f"reference run failed ({run.rc}): {run.stderr[-2000:]}")
    (conv,) = conversation_dirs(home)
    events, problems = normalised_events(conv)
    assert not problems, problems
    if shift and not any(e["type"] == "shift" for e in events):
        raise RuntimeError("the reference session had no context shift: the script no longer fills the context")
    return Reference(events, spans_of(events, script), json.loads(trace_file.read_text()), run.seconds)


def _label(ref: Reference, event: str, n: int, phase: str) -> str:
    """A readable name for a kill point: which operation of the session it interrupts."""
    idx = [i for i, e in enumerate(ref.trace) if e == event][n - 1]
    before = ref.trace[:idx]
    what = {"write:transcript": "transcript append", "write:state": "state record append",
            "write:state_tmp": "state rewrite", "write:meta_tmp": "metadata write", "write:cache_tmp": "prefix cache write",
            "replace:state": "state rewrite rename", "replace:meta": "metadata rename", "decode": "llama decode",
            "shift": "context shift"}.get(event, event)
    if event in ("write:state_tmp", "replace:state"):
        last_shift = max((i for i, e in enumerate(before) if e == "shift"), default=-1)
        last_rewrite = max((i for i, e in enumerate(before) if e == event), default=-1)
        if n == 1:
            what += " (persona prefix)"
        elif last_shift > last_rewrite:
            what += " (snapshot after the shift)"
        else:
            what += " (compaction)"
    if event == "decode":
        notes = [e for e in before if e.startswith("note:")]
        what += " (reply streaming)" if notes and notes[-1] == "note:message:user" else " (prompt)"
    return f"{what} #{n} {phase} [after {before.count('write:transcript')} transcript records]"


def plan(ref: Reference, *, points: int | None, timed: int, rng: random.Random) -> list[KillPoint]:
    """Kill points: every write/rename/shift phase, decodes spread over the session, random delays."""
    by_kind: dict[str, list[KillPoint]] = {}
    seen: dict[str, int] = {}
    decodes = ref.trace.count("decode")
    for ev in ref.trace:
        seen[ev] = seen.get(ev, 0) + 1
        n = seen[ev]
        if ev.startswith("write:"):
            phases = ["before", "torn", "after"]
        elif ev.startswith("replace:") or ev == "shift":
            phases = ["before", "after"]
        else:
            continue
        for ph in phases:
            by_kind.setdefault(ev, []).append(KillPoint(_label(ref, ev, n, ph), {"event": ev, "n": n, "phase": ph}))
    step = max(1, decodes // 24)
    by_kind["decode"] = [KillPoint(_label(ref, "decode", n, "before"), {"event": "decode", "n": n, "phase": "before"})
                         for n in range(step // 2 + 1, decodes + 1, step)]
    hi = max(1.0, ref.seconds * 1.05)
    by_kind["timed"] = [KillPoint(f"timed SIGKILL after {d:.2f}s", delay=d)
                        for d in sorted(rng.uniform(0.2, hi) for _ in range(timed))]
    if points is None:
        return [p for kps in by_kind.values() for p in kps]
    # Stratified: round-robin over the kinds (random order inside each), so every write path gets killed.
    pools = {k: rng.sample(v, len(v)) for k, v in by_kind.items()}
    out: list[KillPoint] = []
    while len(out) < points and any(pools.values()):
        for k in sorted(pools):
            if pools[k] and len(out) < points:
                out.append(pools[k].pop())
    return out


def point_after(ref: Reference, event: str, phase: str, note: str, k: int, skip: int = 0) -> KillPoint:
    """The kill point at the first ``event`` (plus ``skip`` more) after the k-th transcript record ``note``.

    For example ``point_after(ref, "decode", "before", "message:user", 3, skip=5)``: while the reply to the
    third user message streams, after five decodes.
    """
    seen = 0
    count = 0
    for ev in ref.trace:
        if ev == event:
            count += 1
            if seen >= k:
                if skip == 0:
                    return KillPoint(_label(ref, event, count, phase), {"event": event, "n": count, "phase": phase})
                skip -= 1
        elif ev == f"note:{note}":
            seen += 1
    raise LookupError(f"no {event} after {note} #{k}")


def remaining_lines(ref: Reference, script: list[str], have: int) -> tuple[list[str], bool]:
    """The script lines still to send after a kill that left ``have`` events, and whether a reply is pending."""
    for i, (start, end) in enumerate(ref.line_spans):
        if have < end:
            written = ref.events[start:have]
            if written and script[i].startswith("/redo"):
                return script[i + 1:], False  # a /redo killed between its events: the opening finishes it
            pending = any(e["type"] == "message" and e["role"] == "user" for e in written)
            return (script[i + 1:] if pending else script[i:]), pending
    return [], False


def check_disk(conv: Path) -> list[str]:
    """The folder after a clean end: state scans clean and holds exactly the transcript's tokens; no litter."""
    from chatcli.core.files.store import ConversationDir
    from chatcli.core.kv import records as sf
    from chatcli.core.transcript import replay_events

    problems = []
    d = ConversationDir(conv)
    tr = d.read_transcript()
    if tr.problems:
        problems.append(f"transcript still has problems after resume: {tr.problems}")
    want = replay_events(tr.events).tokens()
    res = sf.scan(d.state_path)
    if res.header is None or res.dropped_bytes:
        problems.append(f"state file not clean after resume ({res.problem}, {res.dropped_bytes} bytes dropped)")
    else:
        chunks, _, _n = res.live()
        toks: list[int] = []
        for ch in chunks:
            t, _ = sf.split_cells(sf.read_payload(d.state_path, ch.record), ch.record.p1 - ch.record.p0)
            toks.extend(t[: ch.end - ch.record.p0])
        if toks != want:
            problems.append(f"state holds {len(toks)} tokens that differ from the transcript's {len(want)}")
    litter = [p.name for p in conv.iterdir() if p.name.endswith(".tmp")]
    if litter:
        problems.append(f"temp files left behind: {litter}")
    try:
        d.read_meta()
    except Exception as exc:
        problems.append(f"metadata unreadable: {exc}")
    return problems


def _without_alt(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in e.items() if k != "alt"} for e in events]


_REEVAL = re.compile(r"re-evaluated (\d+) tokens")


def run_point(ref: Reference, point: KillPoint, workdir: Path, script: list[str] = SCRIPT, keep: bool = False) -> Outcome:
    home = Path(tempfile.mkdtemp(prefix="kill-", dir=workdir))
    out = Outcome(point)
    try:
        talk = run_talk(home, script, point)
        out.killed = talk.rc == -signal.SIGKILL
        out.completed = completed_replies(talk.stderr)
        if not out.killed:
            if point.delay is None and talk.rc != 0:
                out.problems.append(f"talk ended with {talk.rc} before the kill point: {talk.stderr[-500:]}")
            if point.delay is None:
                out.problems.append("kill point never reached")
        convs = [c for c in conversation_dirs(home) if (c / "meta.json").exists()]
        if not convs:
            # Killed before the conversation existed: fine only if nothing had been answered yet.
            if out.completed:
                out.lost = out.completed
                out.problems.append(f"no conversation on disk but {out.completed} replies were shown")
            out.opened = False
            out.intact = out.identical = True
            return out
        (conv,) = convs
        events, _ = normalised_events(conv)
        if events != ref.events[: len(events)]:
            out.problems.append("transcript after the kill is not a prefix of the uninterrupted one")
        saved_replies = sum(1 for e in events if e["type"] == "message" and e["role"] == "assistant")
        out.lost = max(0, out.completed - saved_replies)
        if out.lost:
            out.problems.append(f"{out.lost} completed turn(s) missing from the transcript")
        lines, _pending = remaining_lines(ref, script, len(events))
        res = run_resume(home, conv.name, lines)
        out.resume_stderr = res.stderr
        if res.rc != 0 or "resumed" not in res.stderr:
            out.opened = False
            out.problems.append(f"resume failed ({res.rc}): {res.stderr.strip()[-500:]}")
            return out
        m = _REEVAL.search(res.stderr)
        out.intact = bool(m) and int(m.group(1)) == 0
        final, _ = normalised_events(conv)
        # The alternative index is compared apart: /regen on resume numbers a reply after every earlier
        # reply with the same turn index, including replies to undone or shifted-out messages (a known
        # conversation.py bug), so it can differ while the continuation itself is identical.
        out.identical = _without_alt(final) == _without_alt(ref.events)
        out.alt_mislabelled = out.identical and final != ref.events
        if out.intact and not out.identical:
            out.problems.append("state was intact but the continued conversation differs from the uninterrupted one")
        if not out.identical:
            # Rebuilt KV may round differently; still every scripted user message must be there, answered.
            users = [e["text"] for e in final if e["type"] == "message" and e["role"] == "user"]
            if users != [e["text"] for e in ref.events if e["type"] == "message" and e["role"] == "user"]:
                out.problems.append("user messages differ from the script after resume")
            if final and final[-1].get("role") != "assistant":
                out.problems.append("the conversation ends without a reply")
        out.problems.extend(check_disk(conv))
        return out
    finally:
        if not keep and not out.problems:
            shutil.rmtree(home, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", type=int, default=64, help="kill points to try (stratified over write paths)")
    ap.add_argument("--all", action="store_true", help="every precise kill point, plus --timed timed ones")
    ap.add_argument("--timed", type=int, default=12, help="timed kills of the plain chatcli executable")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--workdir", help="keep runs here (default: a temp dir, removed unless a point fails)")
    ap.add_argument("--keep", action="store_true", help="keep every run's CHATCLI_HOME")
    ap.add_argument("--only", help="only kill points whose name matches this regular expression")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    workdir = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="chatcli-faults-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(a.seed)
    t0 = time.monotonic()
    ref = reference(workdir)
    points = plan(ref, points=None if (a.all or a.only) else a.points, timed=a.timed, rng=rng)
    if a.only:
        points = [p for p in points if re.search(a.only, p.label)][: a.points]
    print(f"reference: {len(ref.events)} transcript events, {ref.trace.count('decode')} decodes, "
          f"{ref.seconds:.1f}s; trying {len(points)} kill points", flush=True)
    outcomes = []
    for i, p in enumerate(points, 1):
        o = run_point(ref, p, workdir, keep=a.keep)
        outcomes.append(o)
        flag = "ok  " if o.ok else "FAIL"
        if a.verbose or not o.ok:
            print(f"{flag} {i:3d}/{len(points)} {p.label}: completed {o.completed}, intact {o.intact}, "
                  f"identical {o.identical}" + (" (alt index differs)" if o.alt_mislabelled else "")
                  + (f" -- {'; '.join(o.problems)}" if o.problems else ""), flush=True)
    killed = [o for o in outcomes if o.killed]
    intact = [o for o in outcomes if o.intact and o.opened]
    rebuilt = [o for o in outcomes if o.opened and not o.intact]
    print()
    print(f"kill points tried:                      {len(outcomes)} ({len(killed)} SIGKILLed mid-session, "
          f"{len(outcomes) - len(killed)} timed kills that came after the session ended)")
    print(f"conversations intact:                   {sum(1 for o in outcomes if o.ok)}/{len(outcomes)} "
          f"({sum(1 for o in outcomes if o.opened)} resumed; the rest were killed before the conversation existed)")
    print(f"  state intact, continuation identical: {sum(1 for o in intact if o.identical)}/{len(intact)}")
    print(f"  KV rebuilt from the transcript:       {len(rebuilt)} (continuation identical anyway: "
          f"{sum(1 for o in rebuilt if o.identical)})")
    print(f"turns lost beyond the in-flight one:    {sum(o.lost for o in outcomes)}")
    print(f"replies with another alternative index: {sum(o.alt_mislabelled for o in outcomes)} "
          "(known bug: turn indexes repeat after /undo and shifts)")
    print(f"failures:                               {sum(1 for o in outcomes if not o.ok)}")
    print(f"time:                                   {time.monotonic() - t0:.0f}s (workdir {workdir})")
    if not a.workdir and all(o.ok for o in outcomes) and not a.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_main(sys.argv[2:])
    else:
        sys.exit(main())
