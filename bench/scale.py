"""Issue #23's table: what each operation costs with 10, 1k, 10k and 100k conversations, before and after.

    python -m bench.scale                       # before = main at 1c16758 (git archive), after = this tree
    python -m bench.scale --before /path/to/a/tree --sizes 10,1000,10000,100000 --reps 3

One real conversation is made with `chatcli talk` (the bundled model), then copied into a data directory
per tree that grows from size to size (new ids; the copies' `updated` times spread over a year; 10 % warm):
the same corpus in each tree's own home (written once, hard-linked into the other), so that one tree's
commands (a folder the other does not record, a different index) never show up in the other's column.
The warm copies hard-link the original's `state.kv` (100k real copies would take tens of GB; chatcli
counts an inode once, before and after alike), except the conversations an operation writes to, which
get their own copy. The trees take turns, alternating which goes first (A B B A …), so a change of the
shared machine's load hits both; the load average is recorded with every size.

Measured, each as a whole process where the user would wait for one:
- `chatcli ls` into a pipe (1c16758: every row, its only form; later: the default 50 most recent), as the
  same tree's commands left its folders and again with the index current (the walks each made are recorded), and
  `ls --all` (a tree without `--all`: `ls` again), and `ls` right after the same tree's `fork` made a folder;
- the model load alone (a process that loads the bundled model as `serve` does, nothing else): the part
  of `serve` until /health that no index can change;
- `chatcli resume ID` + one turn (4 tokens), piped;
- `chatcli serve` until `GET /health` answers, then one API request continuing a conversation;
- the per-turn file work besides the model, in-process (2 transcript lines, meta.json, the state budget's
  check twice, as `Session` does per turn): what must stay flat as conversations accumulate.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CHATCLI = [sys.executable, "-m", "chatcli"]
ALPHABET = "abcdefghjkmnpqrstuvwxyz23456789"

TURN_WORK = r"""
import json, os, statistics, sys, time
from chatcli.config.settings import get_paths
try:
    from chatcli.core.files.store import ConversationStore
    from chatcli.core.kv import budget
except ImportError:  # main before the index (1c16758): the same modules one level up
    from chatcli.core.store import ConversationStore
    from chatcli.core import budget
paths = get_paths()
store = ConversationStore(paths.conversations_dir)
conv = store.resolve(sys.argv[1])
conv.lock()
meta = conv.read_meta()
index = getattr(store, "index", None)
def check():
    if index is not None:  # after: what Session._running_total does
        index.note_state(conv)
        return index.state_total() + budget.prefix_bytes(paths.prefix_cache_dir)
    return budget.total_bytes(paths.conversations_dir, paths.prefix_cache_dir)  # before
times = []
for i in range(int(sys.argv[2])):
    t = time.perf_counter()
    conv.append_event({"type": "note", "text": f"bench {i}"})
    check()
    conv.append_event({"type": "note", "text": f"bench reply {i}"})
    check()
    conv.write_meta({**meta, "updated": time.time()})
    times.append((time.perf_counter() - t) * 1000)
conv.unlock()
print(json.dumps({"median_ms": statistics.median(times[1:]), "index": index is not None}))
"""


def environment(tree: Path, home: Path) -> dict[str, str]:
    # Bytecode is cached as in any installation (an environment with PYTHONDONTWRITEBYTECODE set would
    # compile every module on every run: ~0.3 s of a loaded 2-core machine, before and after alike).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "PYTHONPATH": str(tree), "CHATCLI_HOME": str(home), "NO_COLOR": "1"}


def run(tree: Path, home: Path, args: list[str], *, stdin: str | None = None, timeout: float = 600) -> float:
    return run_cpu(tree, home, args, stdin=stdin, timeout=timeout)[0]


def run_cpu(tree: Path, home: Path, args: list[str], *, stdin: str | None = None,
            timeout: float = 600) -> tuple[float, float]:
    """(wall seconds, CPU seconds user + system) of one whole chatcli process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    proc = subprocess.run([*CHATCLI, *args], input=stdin, capture_output=True, text=True,
                          env=environment(tree, home), timeout=timeout, cwd=tree)
    dt = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{tree.name}: chatcli {' '.join(args)} failed: {proc.stderr[-500:]}")
    return dt, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


MODEL_LOAD = r"""
import time
t = time.perf_counter()
from chatcli.backends.llamacpp import Engine
from chatcli.models.resolve import bundled_model_path
Engine(bundled_model_path(), n_ctx=4096).close()
print(time.perf_counter() - t)
"""


def model_load(tree: Path, home: Path) -> float:
    """Seconds of a whole process that only loads the model as `serve` does (imports included)."""
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", MODEL_LOAD], capture_output=True, text=True, check=True,
                   env=environment(tree, home), timeout=600, cwd=tree)
    return time.perf_counter() - t


def before_tree(work: Path, rev: str) -> Path:
    """main at ``rev`` as plain files (``git archive``: no worktree, nothing of this repository changed)."""
    dest = work / f"before-{rev}"
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def index_stamp(home: Path) -> tuple[Any, ...]:
    """What the shared index says about its walks: this tree's counters (``walks_names``, ``walks_full``)
    and the stamps any index-aware tree writes when it walks (``walked_at``, ``root_mtime``), and the count
    of folders made or removed by chatcli itself with their stamp recorded (``own_changes``). A command
    that changed them walked the folders; one that did not answered from the index as it was."""
    import sqlite3

    path = home / "data" / "index.sqlite"
    if not path.exists():
        return ()
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:
            got = dict(db.execute("SELECT key, value FROM info WHERE key IN "
                                  "('walks_names', 'walks_full', 'walked_at', 'root_mtime', 'own_changes')").fetchall())
        finally:
            db.close()
    except sqlite3.Error:
        return ()
    return tuple(got.get(k) for k in ("walks_names", "walks_full", "walked_at", "root_mtime", "own_changes"))


def forget_server_index(home: Path) -> None:
    """What any tree's server keeps of its prefix index (rows in index.sqlite, or server/index.json), so
    that the next `serve` builds it from the transcripts: a first start after the copies, for each tree
    (both trees name their rows alike, so the second would otherwise find the first one's)."""
    import sqlite3

    (home / "data" / "server" / "index.json").unlink(missing_ok=True)
    path = home / "data" / "index.sqlite"
    if not path.exists():
        return
    db = sqlite3.connect(path, timeout=30, isolation_level=None)
    try:
        names = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        db.execute("BEGIN IMMEDIATE")
        for table in ("prefix_convs", "prefix_keys", "prefix_personas", "prefix_counts"):
            if table in names:
                db.execute(f"DELETE FROM {table}")
        if "extra" in names:
            db.execute("DELETE FROM extra WHERE name LIKE 'server-prefix-%'")
        db.execute("COMMIT")
    finally:
        db.close()


def walk_kind(before: tuple[Any, ...], after: tuple[Any, ...]) -> str:
    """"names", "full", "walk" (a tree without the counters walked), or "" (no walk: also when the only
    change is a folder the command made or removed itself, recorded with its stamp: ``own_changes``)."""
    if before == after:
        return ""
    if len(before) == 5 and len(after) == 5:
        if before[0] != after[0]:
            return "names"
        if before[1] != after[1]:
            return "full"
        if before[4] != after[4] and before[2] == after[2]:
            return ""
    return "walk"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(tree: Path, home: Path, conv: str) -> tuple[float, float]:
    """(seconds until /health answers, seconds for one request continuing ``conv``)."""
    port = free_port()
    env = environment(tree, home)
    messages = json.loads(subprocess.run([*CHATCLI, "export", conv, "--format", "json"], capture_output=True,
                                         text=True, env=env, check=True, cwd=tree).stdout)
    # The target is a REPL conversation: an API client now reaches one only with --repl-conversations
    # (main at 1c16758 had neither the rule nor the flag). Without it the request would start a new
    # conversation and evaluate the whole history: not what this column compares. Asked before the clock
    # starts: this `serve --help` process is no part of the server's start.
    repl = ["--repl-conversations"] if "repl-conversations" in subprocess.run(
        [*CHATCLI, "serve", "--help"], capture_output=True, text=True, env=env, cwd=tree).stdout else []
    t = time.perf_counter()
    proc = subprocess.Popen([*CHATCLI, "serve", "--port", str(port), "--max-tokens", "4", *repl], env=env, cwd=tree,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{tree.name}: serve exited: {proc.stderr.read()[-500:] if proc.stderr else ''}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.02)
        ready = time.perf_counter() - t
        body = json.dumps({"messages": [*messages, {"role": "user", "content": "One more word?"}],
                           "temperature": 0, "max_tokens": 4}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        t = time.perf_counter()
        with urllib.request.urlopen(req, timeout=300) as r:
            r.read()
        request = time.perf_counter() - t
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return ready, request


def turn_work(tree: Path, home: Path, conv: str, n: int = 15) -> float:
    env = environment(tree, home)
    out = subprocess.run([sys.executable, "-c", TURN_WORK, conv, str(n)], capture_output=True, text=True,
                         env=env, check=True, timeout=900, cwd=tree).stdout
    return float(json.loads(out.strip().splitlines()[-1])["median_ms"])


class Corpus:
    """Data directories (one per tree) grown alike by copies of one real conversation: the same ids,
    metadata and transcripts in each (written into the first, linked into the others: ``_mirror``)."""

    def __init__(self, homes: list[Path], source: Path) -> None:
        self.roots = [home / "data" / "conversations" for home in homes]
        self.source = source
        self.meta = json.loads((source / "meta.json").read_text())
        self.transcript = (source / "transcript.jsonl").read_bytes()
        self.n = len([p for p in self.roots[0].iterdir() if p.is_dir()])
        self._serial = 0

    def _id(self) -> str:
        self._serial += 1
        n, out = self._serial, ""
        for _ in range(7):
            n, r = divmod(n, len(ALPHABET))
            out += ALPHABET[r]
        return "b" + out  # never an id chatcli's 6-letter ids could take

    def add(self, count: int, *, now: float) -> None:
        first, *others = self.roots
        for _ in range(count):
            cid = self._id()
            d = first / cid
            d.mkdir(mode=0o700)
            warm = self.n % 10 == 0
            updated = now - 365 * 86400 * ((self.n * 7919) % 1000) / 1000  # spread over a year
            meta = {**self.meta, "id": cid, "title": f"copy {self.n}", "updated": updated, "created": updated}
            (d / "transcript.jsonl").write_bytes(self.transcript)
            st = os.stat(d / "transcript.jsonl")  # the summary ties the counts to this copy's transcript
            meta["summary"] = {**meta.get("summary", {}), "transcript": [st.st_size, st.st_mtime_ns]}
            (d / "meta.json").write_text(json.dumps(meta))
            if warm:
                os.link(self.source / "state.kv", d / "state.kv")
            for root in others:
                self._mirror(d, root / cid)
            self.n += 1

    @staticmethod
    def _mirror(src: Path, dest: Path) -> None:
        """The copy ``src`` in another home: its files hard-linked (half the time of writing them again:
        100,000 folders are minutes), copied where the file system cannot link. Safe because no command
        of the run writes to a copy: chatcli rewrites meta.json and state files by renaming a new file
        over them (which unlinks, never changes, the shared one), and appends to the transcripts of
        conversations it continues only: the targets, which every home has as files of its own."""
        dest.mkdir(mode=0o700)
        for f in os.listdir(src):
            try:
                os.link(src / f, dest / f)
            except OSError:
                shutil.copy2(src / f, dest / f)

    def target(self) -> str:
        """A warm conversation of its own in every home (state copied, not linked): resume and serve write
        to it (each tree its own targets; the others' are copies like any)."""
        cid = self._id()
        for root in self.roots:
            shutil.copytree(self.source, root / cid)
            meta = {**self.meta, "id": cid, "title": "bench target", "updated": time.time() - 10 * 365 * 86400}
            (root / cid / "meta.json").write_text(json.dumps(meta))
        self.n += 1
        return cid


# What one copy takes on disk (three small files and the folder, 4 KiB blocks) and in inodes; the check
# before a run asks for twice that (the index files, the page cache's slack).
COPY_BYTES = 16 << 10
COPY_INODES = 4


def check_space(work: Path, folders: int, homes: int) -> None:
    """Refuse a run the disk cannot hold (100,000 folders per home: ~1.6 GB and 400,000 inodes each)."""
    while not work.exists():  # the work directory is made as the run goes: its file system is asked
        work = work.parent
    st = os.statvfs(work)
    need_bytes, need_inodes = 2 * folders * homes * COPY_BYTES, 2 * folders * homes * COPY_INODES
    free_bytes, free_inodes = st.f_bavail * st.f_frsize, st.f_favail
    if free_bytes < need_bytes or (st.f_files and free_inodes < need_inodes):
        sys.exit(f"bench.scale: {work} has {free_bytes / 1e9:.1f} GB and {free_inodes:,} inodes free; "
                 f"{folders:,} folders in each of {homes} homes need ~{need_bytes / 1e9:.1f} GB and "
                 f"{need_inodes:,} inodes")


def make_source(tree: Path, home: Path) -> Path:
    run(tree, home, ["talk", "--temperature", "0", "--max-tokens", "16"], stdin="Name a fruit, in one word.\n")
    (folder,) = [p for p in (home / "data" / "conversations").iterdir() if p.is_dir()]
    return folder


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, help="a tree of main before the index (default: --before-rev)")
    ap.add_argument("--before-rev", default="1c16758", help="the commit `before` is taken from (git archive)")
    ap.add_argument("--after", type=Path, default=REPO)
    ap.add_argument("--sizes", default="10,1000,10000,100000")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/chatcli-scale"))
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "scale.md",
                    help="the results file: the run is added to it as a new `## Run N` section, its data in "
                         "<name>-runN.json and its chart in <name>-runN.png beside it")
    a = ap.parse_args()
    out = a.out.resolve()
    if out.suffix != ".md":
        out = out.with_suffix(".md")
    work = a.work.resolve()
    if out.is_relative_to(work):  # the work directory is deleted at the start and at the end of a run
        ap.error(f"--out {a.out} is inside --work {a.work}, which the run deletes")
    out.parent.mkdir(parents=True, exist_ok=True)
    run_no = next_run(out)
    shutil.rmtree(a.work, ignore_errors=True)
    started = time.perf_counter()
    before = a.before.resolve() if a.before is not None else before_tree(a.work, a.before_rev)
    trees = {"before": before, "after": a.after.resolve()}
    sizes = [int(s) for s in a.sizes.split(",")]
    check_space(a.work, max(sizes) + 2 * a.reps * len(sizes) + 1, len(trees))
    # `ls --all` on both sides when both have it (1c16758 had only `ls`, which lists every row).
    homes = {name: a.work / f"home-{name}" for name in trees}  # each tree its own copy of the corpus
    source_home = a.work / "source"
    source = make_source(trees["after"], source_home)
    has_all = {name: "--all" in subprocess.run([*CHATCLI, "ls", "--help"], capture_output=True, text=True,
                                               env=environment(tree, source_home), cwd=tree).stdout
               for name, tree in trees.items()}
    for home in homes.values():
        (home / "data" / "conversations").mkdir(parents=True)
    corpus = Corpus(list(homes.values()), source)
    results: list[dict[str, Any]] = []
    for size in sizes:
        targets = {name: [corpus.target() for _ in range(a.reps)] for name in trees}
        t = time.perf_counter()
        corpus.add(max(0, size - corpus.n), now=time.time())
        copying = time.perf_counter() - t
        t = time.perf_counter()
        # The index catches up with the new copies (not timed below).
        run(trees["after"], homes["after"], ["ls"], timeout=3600)
        catch_up = time.perf_counter() - t
        run(trees["before"], homes["before"], ["ls"], timeout=3600)  # both: bytecode cached, folders in the page cache
        row: dict[str, Any] = {"size": corpus.n, "load_start": load(), "index_catch_up_s": catch_up,
                               "copying_s": copying}
        # Each server's own cache (before: server/index.json; after: rows in index.sqlite) catches up with
        # the copies once, as the index does above: a server meets 90,000 new folders at once only here.
        # That first start is recorded apart, each tree's from nothing; the timed ones are restarts, as a
        # user's are.
        row["serve_cold_s"] = {}
        for name, tree in trees.items():
            forget_server_index(homes[name])  # each builds its rows from nothing, not from the last size's
            row["serve_cold_s"][name] = serve(tree, homes[name], targets[name][0])[0]
        samples: dict[str, dict[str, list[float]]] = {n: {} for n in trees}
        walks: dict[str, list[str]] = {}
        for rep in range(a.reps):
            order = list(trees) if rep % 2 == 0 else list(reversed(trees))
            for name in order:
                tree, s, home = trees[name], samples[name], homes[name]
                # `ls` first as this tree's commands of the last rep (or size) left its folders (a walk if
                # they moved a stamp: recorded), then again with the index current: the two cases the goal
                # separates.
                stamp = index_stamp(home)
                wall, cpu = run_cpu(tree, home, ["ls"])
                walks.setdefault(name, []).append(walk_kind(stamp, stamp := index_stamp(home)))
                s.setdefault("ls", []).append(wall)
                s.setdefault("ls_cpu", []).append(cpu)
                wall, cpu = run_cpu(tree, home, ["ls"])
                walks.setdefault(name + "_again", []).append(walk_kind(stamp, stamp := index_stamp(home)))
                s.setdefault("ls_current", []).append(wall)
                s.setdefault("ls_current_cpu", []).append(cpu)
                s.setdefault("ls_all", []).append(run(tree, home, ["ls", "--all"] if has_all[name] else ["ls"]))
                walks.setdefault(name + "_all", []).append(walk_kind(stamp, index_stamp(home)))
                # `ls` right after this tree's own `fork` made a conversation folder (the folder's mtime moved:
                # a walk of names, unless the forking process recorded what it changed).
                run(tree, home, ["fork", targets[name][rep]])
                stamp = index_stamp(home)
                s.setdefault("ls_fork", []).append(run(tree, home, ["ls"]))
                walks.setdefault(name + "_fork", []).append(walk_kind(stamp, index_stamp(home)))
                s.setdefault("model_load", []).append(model_load(tree, home))
                cid = targets[name][rep]
                stamp = index_stamp(home)
                s.setdefault("resume_turn", []).append(run(tree, home, [
                    "resume", cid, "--temperature", "0", "--max-tokens", "4"], stdin="One word please.\n"))
                walks.setdefault(name + "_resume", []).append(walk_kind(stamp, stamp := index_stamp(home)))
                ready, request = serve(tree, home, cid)
                walks.setdefault(name + "_serve", []).append(walk_kind(stamp, index_stamp(home)))
                s.setdefault("serve_ready", []).append(ready)
                s.setdefault("request", []).append(request)
                s.setdefault("turn_files_ms", []).append(turn_work(tree, home, cid))
                print(f"size {corpus.n} rep {rep} {name}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in s.items())
                      + ", walks ls/again/all/fork/resume/serve: " + "/".join(
                          walks[name + k][-1] or "-" for k in WALKED), flush=True)
        for name in trees:
            row[name] = {k: statistics.median(v) for k, v in samples[name].items()}
            row[name + "_all"] = samples[name]
        row["walks"] = walks
        row["load_end"] = load()
        row["elapsed_s"] = time.perf_counter() - started
        results.append(row)
        # Written after every size: a run stopped part-way keeps what it measured.
        write_run(results, out, run_no, " ".join(["python -m bench.scale", *sys.argv[1:]]), trees)
    shutil.rmtree(a.work, ignore_errors=True)
    print(f"wrote run {run_no} to {out} ({out.with_name(f'{out.stem}-run{run_no}.json').name}, "
          f"{out.with_name(f'{out.stem}-run{run_no}.png').name})")


COLUMNS = [("ls", "`chatcli ls`", "s"), ("ls_cpu", "`ls` CPU (user+sys)", "s"),
           ("ls_current", "`ls` again", "s"), ("ls_all", "`ls --all`", "s"), ("ls_fork", "`ls` after `fork`", "s"),
           ("resume_turn", "`resume` + 1 turn", "s"), ("serve_ready", "`serve` until /health", "s"),
           ("model_load", "model load alone", "s"), ("request", "one API request", "s"),
           ("turn_files_ms", "per-turn file work", "ms")]


WALKED = ("", "_again", "_all", "_fork", "_resume", "_serve")  # the commands whose walks are recorded (``walks`` keys)


def next_run(out: Path) -> int:
    """The number of the run this one adds to ``out`` (its ``## Run N`` sections + 1)."""
    import re

    try:
        text = out.read_text("utf-8")
    except FileNotFoundError:
        return 1
    return max([int(n) for n in re.findall(r"^## Run (\d+)", text, re.MULTILINE)], default=0) + 1


def run_section(results: list[dict[str, Any]], run_no: int, command: str, trees: dict[str, Path],
                json_name: str, png_name: str | None) -> str:
    """The run's section of the results file: how it ran, the table, the walks each `ls` made."""
    files = f"`{json_name}`" + (f", `{png_name}`" if png_name else "")
    lines = [f"## Run {run_no}: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} ({files})", "",
             f"`{command}`; before = `{trees['before'].name}`, after = `{trees['after'].name}`. Medians of the "
             "reps, each tree against its own copy of the corpus (its own data directory), alternating order. "
             "Whole processes except the "
             "last column (in-process: 2 transcript lines, meta.json and the budget check twice, as every turn "
             "does besides the model). `ls` runs as the same tree's commands of the rep before left its folders "
             "(a walk when they moved a stamp), then `ls` again right after it (no walk unless a stamp moved "
             "less than 50 ms before; 2 s on a file system with whole-second stamps).", "",
             "| conversations | " + " | ".join(f"{t} before → after" for _, t, _ in COLUMNS) + " | load (1/5/15 min) |",
             "|---:|" + "---:|" * len(COLUMNS) + "---|"]
    for r in results:
        cells = []
        for key, _, unit in COLUMNS:
            b, a = r["before"].get(key), r["after"].get(key)
            fmt = "{:.1f}" if unit == "ms" else "{:.2f}"
            cells.append(f"{'–' if b is None else fmt.format(b)} → **{'–' if a is None else fmt.format(a)}** {unit}")
        lines.append(f"| {r['size']:,} | " + " | ".join(cells) + f" | {r['load_start']} → {r['load_end']} |")
    def walked(r: dict[str, Any], name: str) -> str:
        per = [r.get("walks", {}).get(name + k, []) for k in WALKED]
        return " ".join("/".join(w or "-" for w in rep) for rep in zip(*per, strict=False))

    lines += ["", "Walks of the folders (`names`: one scandir; `full`: a stat per folder; `walk`: a tree without "
              "the counters walked; `-`: none), per rep, during `ls` / `ls` again / `ls --all` / `ls` after `fork` / "
              "`resume` / "
              "`serve` (its start and request): " +
              "; ".join(f"{r['size']:,}: before {walked(r, 'before')}, after {walked(r, 'after')}"
                        for r in results) + ".",
              "", "The index catching up with the copies added for each size (`ls`, first run after them): " +
              ", ".join(f"{r['size']:,}: {r['index_catch_up_s']:.1f} s" for r in results) + ".",
              "", "`serve` until /health the first time after the copies (its cache built from nothing; before → after): " +
              ", ".join(f"{r['size']:,}: {r['serve_cold_s']['before']:.1f} → {r['serve_cold_s']['after']:.1f} s"
                        for r in results) + ".",
              "", "Writing the copies for each size into both homes (not timed above): " +
              ", ".join(f"{r['size']:,}: {r.get('copying_s', 0):.1f} s" for r in results) + ".",
              "", f"Whole run: {results[-1].get('elapsed_s', 0) / 60:.1f} min.", ""]
    return "\n".join(lines)


def write_run(results: list[dict[str, Any]], out: Path, run_no: int, command: str, trees: dict[str, Path]) -> None:
    """Add (or, as the run goes on, replace) run ``run_no``'s section in ``out``, newest run first under
    the title, with its data and chart beside it."""
    import re

    json_path = out.with_name(f"{out.stem}-run{run_no}.json")
    png_path = out.with_name(f"{out.stem}-run{run_no}.png")
    json_path.write_text(json.dumps(results, indent=2))
    png = write_chart(results, png_path)
    section = run_section(results, run_no, command, trees, json_path.name, png_path.name if png else None)
    try:
        text = out.read_text("utf-8")
    except FileNotFoundError:
        text = "# Many conversations (issue #23): before and after the SQLite index\n"
    mine = re.compile(rf"^## Run {run_no}:.*?(?=^## Run |\Z)", re.MULTILINE | re.DOTALL)
    if mine.search(text):
        text = mine.sub(lambda _: section + "\n", text, count=1)
    else:
        first = re.search(r"^## Run ", text, re.MULTILINE)
        at = first.start() if first else len(text)
        head = text[:at].rstrip("\n") + "\n\n"
        text = head + section + "\n" + text[at:]
    out.write_text(text.rstrip("\n") + "\n", "utf-8")


def write_chart(results: list[dict[str, Any]], path: Path) -> bool:
    """One panel per column, before and after against the number of conversations; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cols = 3
    rows = -(-len(COLUMNS) // cols)
    fig, grid = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    axes = [ax for line in grid for ax in line]
    for ax in axes[len(COLUMNS):]:
        ax.set_visible(False)
    sizes = [r["size"] for r in results]
    for ax, (key, title, unit) in zip(axes, COLUMNS, strict=False):
        for name, style in (("before", "o--"), ("after", "o-")):
            ax.plot(sizes, [r[name].get(key, float("nan")) for r in results], style, label=name)
        ax.set_xscale("log")
        ax.set_title(title.replace("`", ""), fontsize=9)
        ax.set_xlabel("conversations")
        ax.set_ylabel(unit)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


if __name__ == "__main__":
    main()
