"""chatcli's benchmark suite: one command, results in ``bench/results/`` (Markdown table + PNG charts).

    python -m bench.run                 # full run (~10 min on 2 idle cores)
    python -m bench.run --quick         # small variant (~1-2 min)
    python -m bench.run --model PATH    # another GGUF model

Every figure is measured side by side in this one run, on the same model, threads and context size.
See bench/README.md for what each measurement does.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import report
from bench.common import PERSONA_FACTS, REPO, RESULT_PREFIX

WORKERS = Path(__file__).resolve().parent / "workers.py"

FULL = dict(lengths=[500, 1000, 2000, 3500], reps=3, reingest_reps=1, reply_tokens=48, msg_tokens=300,
            prompt_tokens=512, prompt_chunk=128, decode_tokens=64, pairs=6, persona_tokens=1000, rss_max_tokens=32)
QUICK = dict(lengths=[250, 500], reps=1, reingest_reps=1, reply_tokens=6, msg_tokens=150, prompt_tokens=48, prompt_chunk=16,
             decode_tokens=8, pairs=1, persona_tokens=100, rss_max_tokens=2)

VEGETABLES = [
    ("tomato", "March", 50, 12), ("basil", "April", 25, 8), ("pepper", "February", 45, 16), ("runner bean", "May", 20, 10),
    ("carrot", "April", 5, 11), ("beetroot", "April", 10, 9), ("parsnip", "March", 15, 18), ("lettuce", "March", 25, 7),
    ("spinach", "September", 15, 6), ("kale", "May", 45, 10), ("leek", "March", 15, 20), ("onion", "March", 10, 20),
    ("garlic", "October", 15, 32), ("potato", "April", 35, 15), ("courgette", "May", 90, 9), ("pumpkin", "May", 150, 17),
    ("pea", "March", 8, 12), ("broad bean", "November", 20, 26), ("radish", "April", 3, 4), ("chard", "April", 30, 9),
    ("cucumber", "May", 45, 10), ("sweetcorn", "May", 35, 14), ("cabbage", "April", 45, 16), ("broccoli", "April", 45, 14),
    ("cauliflower", "April", 60, 18), ("celery", "March", 30, 18), ("fennel", "June", 30, 12), ("turnip", "July", 15, 8),
    ("rocket", "April", 10, 5), ("coriander", "May", 10, 6), ("parsley", "March", 15, 10), ("dill", "April", 20, 8),
    ("thyme", "April", 30, 14), ("sage", "April", 45, 16), ("oregano", "April", 30, 14), ("mint", "April", 45, 10),
    ("strawberry", "August", 35, 40), ("rhubarb", "March", 90, 52), ("asparagus", "April", 45, 104), ("shallot", "March", 15, 16),
]


def persona_toml(n_tokens: int) -> str:
    """A persona whose system prompt is about ``n_tokens`` long (4 characters a token, roughly)."""
    lines: list[str] = []
    for fact in PERSONA_FACTS:
        if sum(len(x) + 1 for x in lines) >= 4 * n_tokens:
            break
        lines.append(fact)
    if sum(len(x) + 1 for x in lines) < 4 * n_tokens:
        lines.append("Reference notes you can rely on:")
    i = 0
    while sum(len(x) + 1 for x in lines) < 4 * n_tokens:
        name, month, cm, weeks = VEGETABLES[i % len(VEGETABLES)]
        extra = "" if i < len(VEGETABLES) else " In a cold year, wait two more weeks and protect seedlings with fleece."
        lines.append(f"- {name.capitalize()}: sow or plant in {month}, about {cm} cm apart; first harvest after "
                     f"about {weeks} weeks.{extra}")
        i += 1
    system = "\n".join(lines)
    return (
        'name = "long"\n'
        'description = "Benchmark persona with a long system prompt."\n'
        f'system = """\n{system}\n"""\n'
        'greeting = "Hello! Tell me about your garden."\n\n'
        "[[examples]]\n"
        'user = "When should I sow tomatoes?"\n'
        'assistant = "Indoors in March, then plant them out after the last frost."\n'
    )


class Bench:
    def __init__(self, opts: argparse.Namespace, cfg: dict[str, Any]) -> None:
        self.o = opts
        self.cfg = cfg
        self.work = Path(opts.work) if opts.work else Path(tempfile.mkdtemp(prefix="chatcli-bench-"))
        self.work.mkdir(parents=True, exist_ok=True)
        (self.work / "logs").mkdir(exist_ok=True)
        self.n_runs = 0
        self.t_start = time.perf_counter()
        env = {k: v for k, v in os.environ.items() if not k.startswith("CHATCLI_")}
        env["NO_COLOR"] = "1"
        env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        if opts.omp_wait_policy == "chatcli":
            # chatcli's own policy (#22): libgomp's default wait and chatcli's thread choice, so nothing
            # inherited from the shell that starts the bench may change it.
            for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
                env.pop(k, None)
        elif opts.omp_wait_policy != "inherit":
            env["OMP_WAIT_POLICY"] = opts.omp_wait_policy.upper()
        self.env = env
        self.before: Path | None = None  # the "before" tree (chatcli of an older commit), see prepare_before

    def prepare_before(self) -> dict[str, Any] | None:
        """Extract chatcli as of ``--before REV`` (git archive: the repository is not touched) so the same
        run measures the old code next to the new one, with this benchmark's workers."""
        rev = self.o.before
        if not rev or rev == "none":
            return None
        dest = self.work / "before"
        dest.mkdir(exist_ok=True)
        arch = subprocess.run(["git", "-C", str(REPO), "archive", rev, "chatcli", "personas"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(dest)], input=arch.stdout, check=True)
        desc = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%h", rev], capture_output=True,
                              text=True, check=True).stdout.strip()
        self.before = dest
        return {"rev": rev, "describe": desc}

    def log(self, msg: str) -> None:
        print(f"[bench {time.perf_counter() - self.t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    def base(self) -> dict[str, Any]:
        return {"model": self.o.model, "n_ctx": self.o.n_ctx, "threads": self.o.threads}

    def worker(self, mode: str, args: dict[str, Any], home: Path | None = None, tree: Path | None = None) -> dict[str, Any]:
        self.n_runs += 1
        tag = f"{self.n_runs:03d}-{mode}" + ("-before" if tree else "")
        arg_file = self.work / "logs" / f"{tag}.json"
        if mode == "startup":
            args = {**args, "t_spawn": time.time()}
        arg_file.write_text(json.dumps(args))
        env = dict(self.env)
        if tree is not None:
            env["BENCH_CHATCLI_ROOT"] = str(tree)
        env["CHATCLI_HOME"] = str(home or self.work / "home-scratch")
        err_path = self.work / "logs" / f"{tag}.err"
        out_path = self.work / "logs" / f"{tag}.out"
        t0 = time.perf_counter()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            p = subprocess.Popen([sys.executable, str(WORKERS), mode, f"@{arg_file}"], env=env, cwd=str(REPO),
                                 stdin=subprocess.DEVNULL, stdout=out, stderr=err)
            try:
                p.wait(timeout=self.o.timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                raise RuntimeError(f"worker {mode} timed out after {self.o.timeout:.0f} s; see {err_path}") from None
        with open(self.work / "logs" / "timing.tsv", "a") as fh:
            fh.write(f"{tag}\t{time.perf_counter() - t0:.2f}\n")
        lines = [ln for ln in out_path.read_text().splitlines() if ln.startswith(RESULT_PREFIX)]
        if p.returncode != 0 or not lines:
            tail = "\n".join(err_path.read_text(errors="replace").strip().splitlines()[-15:])
            raise RuntimeError(f"worker {mode} failed (exit {p.returncode}):\n{tail}")
        return json.loads(lines[-1][len(RESULT_PREFIX):])

    def peak_rss(self, cmd: list[str], stdin: bytes, home: Path) -> tuple[int, int]:
        """Run ``cmd`` and return (exit code, peak RSS in bytes) of that one child (wait4, not RUSAGE_CHILDREN)."""
        env = dict(self.env)
        env["CHATCLI_HOME"] = str(home)
        self.n_runs += 1
        log = self.work / "logs" / f"{self.n_runs:03d}-rss.log"
        with open(log, "wb") as out:
            p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, env=env,
                                 cwd=str(self.work))
            assert p.stdin is not None
            p.stdin.write(stdin)
            p.stdin.close()
            _, status, ru = os.wait4(p.pid, 0)
            p.returncode = os.waitstatus_to_exitcode(status)
        return p.returncode, int(ru.ru_maxrss) * 1024  # Linux reports KiB

    def timed_cmd(self, cmd: list[str], stdin: bytes, home: Path, tree: Path | None) -> float:
        """Wall time (ms) of a whole chatcli process, from spawn to exit."""
        env = dict(self.env)
        env["CHATCLI_HOME"] = str(home)
        if tree is not None:
            env["PYTHONPATH"] = str(tree) + os.pathsep + env["PYTHONPATH"]
        self.n_runs += 1
        log = self.work / "logs" / f"{self.n_runs:03d}-cmd{'-before' if tree else ''}.log"
        with open(log, "wb") as out:
            t0 = time.perf_counter()
            p = subprocess.run(cmd, input=stdin, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(self.work),
                               timeout=self.o.timeout)
            dt = time.perf_counter() - t0
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited with {p.returncode}; see {log}")
        return 1000 * dt

    def startup_phase(self, cks: list[dict[str, Any]]) -> dict[str, Any]:
        """Whole processes, after (this tree) and before (--before): `talk` and `resume` of the checkpoint
        nearest 2,000 tokens to the first token (CLI wall time + an in-process breakdown), and `ls` with
        100 conversations."""
        c = self.cfg
        ck = min(cks, key=lambda x: abs(x["n_tokens"] - 2000))
        trees: list[tuple[str, Path | None]] = [("after", None)] + ([("before", self.before)] if self.before else [])
        out: dict[str, Any] = {"tokens": ck["n_tokens"], "target": ck["target"]}
        for name, _ in trees:
            out[name] = {k: [] for k in ("talk", "resume", "talk_cli_ms", "resume_cli_ms", "ls_cli_ms")}
        py = [sys.executable, "-m", "chatcli"]
        common = ["--temperature", "0", "--threads", str(self.o.threads), "--max-tokens", "1"]
        if self.o.model:
            common += ["--model", self.o.model]
        build_cache = self.work / "build-home" / "cache"
        sdir = self.work / "startup"
        # ls: 100 conversations (metadata and transcript copies of the smallest checkpoint; ls reads no state).
        from chatcli.core.files.store import new_id

        ls_home = sdir / "ls-home"
        src = Path(cks[0]["home"]) / "data" / "conversations" / cks[0]["conv_id"]
        root = ls_home / "data" / "conversations"
        root.mkdir(parents=True, exist_ok=True)
        for _ in range(100):
            cid = new_id()
            d = root / cid
            shutil.copytree(src, d, ignore=shutil.ignore_patterns("state.kv*", "*.lock"))
            meta = json.loads((d / "meta.json").read_text())
            meta["id"] = cid
            (d / "meta.json").write_text(json.dumps(meta))
        for rep in range(c["reps"]):
            for name, tree in (trees if rep % 2 == 0 else trees[::-1]):
                o = out[name]
                for kind in ("talk", "resume"):
                    for via in ("worker", "cli"):
                        home = sdir / "home"
                        if home.exists():
                            shutil.rmtree(home)
                        if kind == "talk":
                            home.mkdir(parents=True)
                            if build_cache.exists():  # a returning user: the persona prefix is cached
                                shutil.copytree(build_cache, home / "cache")
                        else:
                            shutil.copytree(ck["home"], home)
                        if via == "worker":
                            o[kind].append(self.worker("startup", {
                                **self.base(), "home": str(home), "kind": kind, "conv_id": ck["conv_id"]},
                                home=home, tree=tree))
                        else:
                            args = ["talk", "--n-ctx", str(self.o.n_ctx)] if kind == "talk" else ["resume", ck["conv_id"]]
                            o[f"{kind}_cli_ms"].append(self.timed_cmd(py + args + common, b"hi\n", home, tree))
                o["ls_cli_ms"].append(self.timed_cmd([*py, "ls"], b"", ls_home, tree))
            self.log(f"  rep {rep + 1}/{c['reps']} done")
        return out

    # -- phases ------------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        c = self.cfg
        res: dict[str, Any] = {"config": {**c, "n_ctx": self.o.n_ctx, "threads": self.o.threads,
                                          "omp_wait_policy": self.env.get("OMP_WAIT_POLICY", "(unset: chatcli's own policy)"),
                                          "quick": self.o.quick}}
        res["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                          "load_start": os.getloadavg()}
        try:
            import llama_cpp

            res["machine"]["llama_cpp_python"] = llama_cpp.__version__
        except Exception:
            pass
        try:
            import typer  # both trees of section 7 run on this typer (< 0.29 imports no pydantic: #15 goal 3b)

            res["machine"]["typer"] = typer.__version__
        except Exception:
            pass

        res["before"] = self.prepare_before()
        # Both trees as an installed package has them: bytecode compiled once, up front. Without it, an
        # environment with PYTHONDONTWRITEBYTECODE (these machines set it) compiles every imported module
        # from source in every process, which is a cost of the environment, not of either tree.
        for tree in [REPO, *([self.before] if self.before else [])]:
            subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree / "chatcli")], check=True)
        res["machine"]["bytecode"] = "precompiled (compileall) for both trees"
        self.log(f"building conversations to {c['lengths']} tokens (work dir {self.work})")
        b = self.worker("build", {**self.base(), "home": str(self.work / "build-home"), "lengths": c["lengths"],
                                  "reply_tokens": c["reply_tokens"], "msg_tokens": c["msg_tokens"],
                                  "ckpt_root": str(self.work / "ckpt")})
        res["build"] = {k: v for k, v in b.items() if k != "checkpoints"}
        cks = b["checkpoints"]
        res["checkpoints"] = [{k: v for k, v in ck.items() if k not in ("tokens", "next_tokens")} for ck in cks]
        model_path = b["model_path"]

        self.log("resume in a new process vs cold re-ingest vs llama-cpp-python save/load_state and LlamaDiskCache")
        # resume_before: the same restore by chatcli as of --before (same worker, older chatcli).
        modes = ["resume", "llama_state", "llama_diskcache"] + (["resume_before"] if self.before else [])
        resume: dict[str, dict[str, list[Any]]] = {str(ck["target"]): {m: [] for m in modes} for ck in cks}
        run_dir = self.work / "run"
        for rep in range(c["reps"]):
            for j, ck in enumerate(cks):
                k = (rep + j) % len(modes)
                for mode in modes[k:] + modes[:k]:
                    args = {**self.base(), "model_path": model_path, "tokens": ck["tokens"],
                            "next_tokens": ck["next_tokens"], "conv_id": ck["conv_id"]}
                    if run_dir.exists():
                        shutil.rmtree(run_dir)
                    run_dir.mkdir()
                    if mode in ("resume", "resume_before"):
                        home = run_dir / "home"
                        shutil.copytree(ck["home"], home)
                        args["home"] = str(home)
                    elif mode == "llama_state":
                        args["path"] = ck["llama_state_path"]
                    else:
                        args["cache_dir"] = str(run_dir / "diskcache")
                        shutil.copytree(ck["diskcache_dir"], args["cache_dir"])
                    out = self.worker(mode.replace("_before", ""), args, home=Path(args.get("home", run_dir / "scratch-home")),
                                      tree=self.before if mode == "resume_before" else None)
                    resume[str(ck["target"])][mode].append(out)
            self.log(f"  rep {rep + 1}/{c['reps']} done")
        res["resume"] = resume

        self.log("re-ingest baselines (cold resume, /regen, /edit): one pass over the conversation per repetition")
        ri_args = {**self.base(), "model_path": model_path, "tokens": cks[-1]["tokens"],
                   "checkpoints": [{k: ck[k] for k in ("target", "n_tokens", "tokens", "next_tokens", "user_p0",
                                                        "reply_p0", "edit_tokens")} for ck in cks]}
        res["reingest"] = [self.worker("reingest", ri_args)["reingest"] for _ in range(c["reingest_reps"])]

        self.log("/regen and /edit in chatcli")
        rb_cks = []
        for ck in cks:
            home = self.work / "rollback" / f"L{ck['target']}"
            if home.exists():
                shutil.rmtree(home)
            shutil.copytree(ck["home"], home)
            rb_cks.append({"home": str(home), "conv_id": ck["conv_id"], "target": ck["target"]})
        res["rollback"] = self.worker("rollback", {**self.base(), "checkpoints": rb_cks, "reps": c["reps"]},
                                      home=Path(rb_cks[0]["home"]))["rollback"]

        self.log("decode / prompt-eval throughput: chatcli engine vs bare llama-cpp-python loop")
        thr_args = {**self.base(), "model_path": model_path, "prompt_tokens": c["prompt_tokens"],
                    "prompt_chunk": c["prompt_chunk"], "decode_tokens": c["decode_tokens"], "pairs": c["pairs"]}
        res["throughput"] = self.worker("throughput", thr_args)
        if self.before:
            res["throughput_before"] = self.worker("throughput", thr_args, tree=self.before)

        self.log("whole processes: talk / resume to the first token, ls with 100 conversations (after, before)")
        res["startup"] = self.startup_phase(cks)

        self.log("peak RSS: chatcli talk vs bare llama-cpp-python")
        exe = Path(sys.executable).parent / "chatcli"
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "chatcli"]
        cmd += ["talk", "--temperature", "0", "--n-ctx", str(self.o.n_ctx), "--threads", str(self.o.threads),
                "--max-tokens", str(c["rss_max_tokens"])]
        if self.o.model:
            cmd += ["--model", self.o.model]
        # The persona prefix cache the build left is copied in: the steady state of a returning user, and it
        # spares re-evaluating the prefix (peak memory is the model and the KV either way).
        rss_home = self.work / "rss-home"
        build_cache = self.work / "build-home" / "cache"
        if build_cache.exists():
            shutil.copytree(build_cache, rss_home / "cache", dirs_exist_ok=True)
        code, rss = self.peak_rss(cmd, b"hi\n", rss_home)
        if code != 0:
            raise RuntimeError(f"chatcli talk exited with {code}; see {self.work / 'logs'}")
        args_file = self.work / "logs" / "llama_rss.json"
        args_file.write_text(json.dumps({**self.base(), "model_path": model_path, "max_tokens": c["rss_max_tokens"]}))
        code2, rss2 = self.peak_rss([sys.executable, str(WORKERS), "llama_rss", f"@{args_file}"], b"",
                                    self.work / "rss-home2")
        if code2 != 0:
            raise RuntimeError(f"llama_rss worker exited with {code2}; see {self.work / 'logs'}")
        code3, rss3 = self.peak_rss(
            [sys.executable, "-c", "import chatcli.cli.app, chatcli.backends.llamacpp, chatcli.repl.loop"], b"",
                                    self.work / "rss-home3")
        # And resuming the longest conversation: restoring its state file adds buffers of its own.
        last = cks[-1]
        rhome = self.work / "rss-resume-home"
        if rhome.exists():
            shutil.rmtree(rhome)
        shutil.copytree(last["home"], rhome)
        prog = 1 if cmd[0] != sys.executable else 3  # the chatcli script, or python -m chatcli
        cmd_r = cmd[:prog] + ["resume", last["conv_id"], "--temperature", "0", "--threads", str(self.o.threads),
                  "--max-tokens", str(c["rss_max_tokens"])] + (["--model", self.o.model] if self.o.model else [])
        code4, rss4 = self.peak_rss(cmd_r, b"hi\n", rhome)
        if code4 != 0:
            raise RuntimeError(f"chatcli resume exited with {code4}; see {self.work / 'logs'}")
        res["memory"] = {"chatcli_talk_rss": rss, "llama_rss": rss2, "python_imports_rss": rss3 if code3 == 0 else None,
                         "chatcli_resume_rss": rss4, "resume_tokens": last["n_tokens"],
                         "resume_state_bytes": last["state_bytes"],
                         "model_file_bytes": b["model_file_bytes"], "kv_bytes_per_token": b["kv_bytes_per_token"],
                         "kv_bytes": b["kv_bytes_per_token"] * b["n_ctx"], "n_ctx": b["n_ctx"], "cmd": " ".join(cmd[prog:])}

        self.log(f"persona prefix cache: new conversation with a ~{c['persona_tokens']}-token persona")
        phome = self.work / "persona-home"
        pdir = phome / "config" / "personas"
        pdir.mkdir(parents=True, exist_ok=True)
        (pdir / "long.toml").write_text(persona_toml(c["persona_tokens"]))
        res["persona"] = self.worker("persona", {**self.base(), "home": str(phome), "reps": c["reps"],
                                                 "reingest_reps": c["reingest_reps"]}, home=phome)

        res["machine"]["load_end"] = os.getloadavg()
        res["seconds"] = time.perf_counter() - self.t_start
        return res


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF model file (default: the bundled SmolLM2-135M)")
    ap.add_argument("--quick", action="store_true", help="small variant: short conversations, one repetition")
    ap.add_argument("--lengths", help="comma-separated conversation lengths in tokens (default 500,1000,2000,3500)")
    ap.add_argument("--reps", type=int, help="repetitions of each timed measurement (default 3, quick 1)")
    ap.add_argument("--reingest-reps", type=int,
                    help="repetitions of the baselines that evaluate everything (the re-ingest pass, uncached "
                         "persona); default 1")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads for every method (default 2)")
    ap.add_argument("--n-ctx", type=int, default=4096, help="context size for every method (default 4096)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="results directory")
    ap.add_argument("--work", help="scratch directory (default: a new temp dir, removed afterwards)")
    ap.add_argument("--keep-work", action="store_true", help="keep the scratch directory (logs, checkpoints)")
    ap.add_argument("--omp-wait-policy", choices=["chatcli", "passive", "active", "inherit"], default="chatcli",
                    help="OMP_WAIT_POLICY for every measuring process (default chatcli: unset, as chatcli runs since "
                         "#22; passive = what it set before, faster only while another process holds a core)")
    # The before tree restores this tree's state files, so it must read them: 9e58edb (main before #15, the
    # tables' first "before") takes a record kind it does not know for damage and re-evaluates, and every
    # turn now writes HISTORY records. 9defbdd (session 10's landing) skips kinds it does not know.
    ap.add_argument("--before", default="9defbdd",
                    help="git revision whose chatcli is measured next to this tree's for the before/after tables "
                         "(default 9defbdd, the last before HISTORY records; it must read this tree's state "
                         "files; 'none' to skip)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds allowed per worker process")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    o = parse_args(argv)
    cfg = dict(QUICK if o.quick else FULL)
    if o.lengths:
        cfg["lengths"] = sorted(int(x) for x in o.lengths.split(",") if x.strip())
    if o.reps:
        cfg["reps"] = o.reps
    if o.reingest_reps:
        cfg["reingest_reps"] = o.reingest_reps
    if o.model:
        o.model = str(Path(o.model).expanduser().resolve())
    if max(cfg["lengths"]) + 300 > o.n_ctx:
        print(f"lengths must stay below n_ctx - 300 ({o.n_ctx - 300})", file=sys.stderr)
        return 2
    # Nothing the benchmark runs may touch the real chatcli home.
    bench = Bench(o, cfg)
    os.environ["CHATCLI_HOME"] = str(bench.work / "home-orchestrator")
    try:
        res = bench.run()
        res["command"] = " ".join(["python -m bench.run", *(argv if argv is not None else sys.argv[1:])])
        out = Path(o.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(res, indent=1))
        files = report.write(res, out)
        bench.log("wrote " + ", ".join(str(f) for f in [out / "results.json", *files]))
    finally:
        if not o.keep_work and not o.work:
            shutil.rmtree(bench.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
