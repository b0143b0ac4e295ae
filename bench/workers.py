"""The benchmark's measuring processes. ``run.py`` starts each one as ``python bench/workers.py MODE JSON``.

Every worker loads its model *before* its clock starts (model loading is the same for every method
compared), measures, and prints one ``BENCH_RESULT {json}`` line. Timings are ``time.perf_counter``
inside the worker, so process start-up and imports are never part of a figure.
"""

from __future__ import annotations

import time

_T_TOP = time.time()  # wall clock as this module starts: the end of interpreter start-up (startup mode)

import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    EDIT_MSG,
    NEXT_MSG,
    PARAGRAPHS,
    build_session,
    compute_runner,
    dir_bytes,
    drain,
    emit,
    first_token,
    llama_kwargs,
    read_llama_state,
    write_llama_state,
)

# ``BENCH_CHATCLI_ROOT``: measure another copy of chatcli (the "before" tree: main at an older commit) with
# this benchmark's own code. ``bench`` is imported above, so only ``chatcli`` comes from there.
if os.environ.get("BENCH_CHATCLI_ROOT"):
    sys.path.insert(0, os.environ["BENCH_CHATCLI_ROOT"])

ms = 1000.0


def _pc() -> float:
    return time.perf_counter()


# -- build: grow one conversation through the lengths, recording per-turn snapshot costs ---------------------


def build(a: dict[str, Any]) -> dict[str, Any]:
    """Drive a chatcli conversation (greedy, short replies, long user messages) up to each target length.

    At each target the conversation folder is copied aside (a checkpoint to resume from), and the same
    tokens are given to llama-cpp-python's ``Llama`` to produce its ``save_state()`` file and a
    ``LlamaDiskCache`` entry. Per turn, chatcli's append is compared with rewriting the whole state.
    """
    from chatcli.core.kv import records as sf
    from chatcli.core.transcript import replay_events

    home = Path(a["home"])
    session = build_session(home, model=a["model"], n_ctx=a["n_ctx"], threads=a["threads"], max_tokens=a["reply_tokens"])
    eng = session.engine
    conv, _, _, _ = drain(session.new_conversation("alice"))
    state_path = conv.dir.state_path

    # KV bytes per token: the difference between saving 2 and 1 cells (llama.cpp's own accounting).
    kv_per_token = len(eng.save_cells(0, 2)) - len(eng.save_cells(0, 1))

    # Count the KV extraction chatcli does for its per-turn records (llama_state_seq_get_data), not only the
    # file write TurnStats.save_ms covers: wrap this process's engine instance (instrumentation, no core edit).
    orig_save_cells = eng.save_cells
    extract = {"s": 0.0}

    def timed_save_cells(p0: int, p1: int) -> bytes:
        t = _pc()
        try:
            return orig_save_cells(p0, p1)
        finally:
            extract["s"] += _pc() - t

    eng.save_cells = timed_save_cells  # type: ignore[method-assign]

    llm = None
    if a.get("llama", True):
        from llama_cpp import Llama

        llm = Llama(model_path=str(session.model.path), **llama_kwargs(a["n_ctx"], a["threads"]))
    scratch = home / "rewrite-baseline.kv"
    header = sf.encode_record(sf.HEADER, 0, 0, sf.header_payload(conv.state_identity()))

    corpus = " ".join(PARAGRAPHS)
    corpus_tokens = eng.tokenize(corpus, add_special=False)

    def message(i: int, n_tokens: int) -> str:
        start = (i * 97) % max(1, len(corpus_tokens) - n_tokens)
        body = eng.detokenize(corpus_tokens[start:start + n_tokens], special=False).strip()
        return f"Note {i + 1}. {body} What do you suggest?"

    turns: list[dict[str, Any]] = []
    checkpoints: list[dict[str, Any]] = []
    ckpt_root = Path(a["ckpt_root"])
    i = 0
    for target in a["lengths"]:
        # At least one exchange per checkpoint (so /regen has a reply), then until within ~2 % of the target: the
        # last message is sized to land on it (user glue ~10 tokens, the reply up to reply_tokens).
        first = True
        while first or eng.n_past < target - max(8, target // 50):
            first = False
            room = target - eng.n_past - a["reply_tokens"] - 16
            n_msg = max(16, min(a["msg_tokens"], room))
            size0 = state_path.stat().st_size
            extract["s"] = 0.0
            t0 = _pc()
            _, _, ends, _ = drain(conv.send(message(i, n_msg)))
            wall = _pc() - t0
            st = ends[-1].stats
            size1 = state_path.stat().st_size
            n = eng.n_past
            # The alternative: rewrite the whole state (all cells + the logits) atomically every turn.
            t1 = _pc()
            kv = orig_save_cells(0, n)
            recs = [header, sf.encode_record(sf.SNAPSHOT, 0, n, sf.cells_payload(eng.tokens, kv))]
            if conv.turn_logits is not None:
                pos, arr = conv.turn_logits
                recs.append(sf.encode_record(sf.LOGITS, pos, pos, arr.astype("<f4").tobytes()))
            rewrite_bytes = sf.StateWriter(scratch).rewrite(recs)
            rewrite_ms = ms * (_pc() - t1)
            del kv, recs
            turns.append({
                "turn": i + 1, "n_past": n, "n_prompt": st.n_prompt, "n_generated": st.n_generated,
                "append_bytes": st.state_bytes, "file_delta": size1 - size0,
                "append_write_ms": st.save_ms, "append_extract_ms": ms * extract["s"],
                "append_ms": st.save_ms + ms * extract["s"],
                "rewrite_bytes": rewrite_bytes, "rewrite_ms": rewrite_ms, "turn_wall_ms": ms * wall,
            })
            i += 1
        # Checkpoint: a copy of the conversation home, resumable in another process.
        cdir = ckpt_root / f"L{target}"
        chome = cdir / "home"
        if cdir.exists():
            shutil.rmtree(cdir)
        shutil.copytree(home, chome, ignore=shutil.ignore_patterns("lock", "rewrite-baseline.kv"))
        r = replay_events(conv.dir.read_transcript().events)
        history = [*r.persona_messages, *(m.as_message() for m in r.active)]
        assert r.tokens() == eng.tokens, "transcript tokens differ from the context"
        next_tokens = eng.tokenize(session.template.user_turn(history, NEXT_MSG), add_special=False)
        # What /regen and /edit of the last exchange would have to re-ingest without chatcli's state.
        last_user = [m for m in r.active if m.role == "user"][-1]
        before_user = [*r.persona_messages, *(m.as_message() for m in r.active if m.p0 < last_user.p0)]
        edit_tokens = eng.tokenize(session.template.user_turn(before_user, EDIT_MSG), add_special=False)
        ck: dict[str, Any] = {
            "target": target, "n_tokens": eng.n_past, "conv_id": conv.id, "home": str(chome),
            "state_bytes": (chome / "data" / "conversations" / conv.id / "state.kv").stat().st_size,
            "next_tokens": next_tokens, "tokens": list(eng.tokens), "turns": conv.n_turns,
            "user_p0": last_user.p0, "reply_p0": last_user.p1, "edit_tokens": edit_tokens,
        }
        if llm is not None:
            have = llm.n_tokens
            llm.eval(eng.tokens[have:])
            state = llm.save_state()
            ck["llama_state_path"] = str(cdir / "llama_state.bin")
            ck["llama_state_file_bytes"] = write_llama_state(Path(ck["llama_state_path"]), state)
            ck["llama_state_bytes"] = len(state.llama_state)
            from llama_cpp.llama_cache import LlamaDiskCache

            cache_dir = cdir / "diskcache"
            cache = LlamaDiskCache(cache_dir=str(cache_dir), capacity_bytes=1 << 40)
            cache[list(eng.tokens)] = state
            cache.cache.close()
            ck["diskcache_dir"] = str(cache_dir)
            ck["diskcache_bytes"] = dir_bytes(cache_dir)
            del state
        checkpoints.append(ck)
    conv.close()
    info = session.model.info
    md = info.metadata
    arch = info.architecture
    kv_meta = None
    try:
        n_layer = int(md[f"{arch}.block_count"])
        n_head = int(md[f"{arch}.attention.head_count"])
        n_head_kv = int(md.get(f"{arch}.attention.head_count_kv", n_head))
        head_k = int(md.get(f"{arch}.attention.key_length", int(md[f"{arch}.embedding_length"]) // n_head))
        head_v = int(md.get(f"{arch}.attention.value_length", head_k))
        kv_meta = n_layer * n_head_kv * (head_k + head_v) * 2  # f16 K and V
    except (KeyError, ValueError, ZeroDivisionError):
        pass
    return {
        "turns": turns, "checkpoints": checkpoints, "kv_bytes_per_token_saved": kv_per_token,
        "kv_bytes_per_token": kv_meta or kv_per_token, "model_path": str(session.model.path),
        "model_name": info.name, "model_file_bytes": info.file_size, "n_ctx": eng.n_ctx, "threads": eng.n_threads,
        "prefix_tokens": len(conv.r.prefix_tokens),
    }


# -- resume in a new process, and the three alternatives ------------------------------------------------------


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # only clean pages can be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resume(a: dict[str, Any]) -> dict[str, Any]:
    """chatcli: restore the KV from the state file, then the next message's first token."""
    session = build_session(a["home"], model=a["model"], n_ctx=a["n_ctx"], threads=a["threads"], max_tokens=16)
    state_path = session.store.resolve(a["conv_id"]).state_path
    size = state_path.stat().st_size
    t0 = _pc()
    conv, report, _, _ = drain(session.open_conversation(a["conv_id"]))
    t_restored = _pc()
    t_first, _ = first_token(conv, conv.send(NEXT_MSG))
    conv.close()
    # The same number of bytes read back-to-back by Python (the file is in the page cache either way: it was
    # just copied, and the restore read it too).
    reads = []
    for _ in range(3):
        t = _pc()
        with open(state_path, "rb") as fh:
            data = fh.read(size)
        reads.append(_pc() - t)
        assert len(data) == size
        del data
    # Once more with state.kv dropped from the page cache (fsync, then posix_fadvise DONTNEED: no root needed):
    # the same restore and the same plain read, both from the disk.
    size2 = state_path.stat().st_size
    _drop_cache(state_path)
    conv, report2, _, _ = drain(session.open_conversation(a["conv_id"]))
    conv.close()
    _drop_cache(state_path)
    t = _pc()
    with open(state_path, "rb") as fh:
        n2 = len(fh.read(size2))
    cold_read = _pc() - t
    assert n2 == size2
    return {
        "cold_state_restore_ms": ms * report2.seconds, "cold_plain_read_ms": ms * cold_read,
        "cold_reevaluated": report2.reevaluated, "cold_file_bytes": size2,
        "restore_ms": ms * (t_restored - t0), "ttft_ms": ms * (t_first - t0), "state_restore_ms": ms * report.seconds,
        "reevaluated": report.reevaluated, "restored_tokens": report.restored_tokens, "state_file_bytes": size,
        "plain_read_ms": ms * min(reads), "reason": report.reason,
    }


def reingest(a: dict[str, Any]) -> dict[str, Any]:
    """Every re-ingest baseline (cold resume, /regen, /edit, at every length) in one pass over the conversation.

    The checkpoints are prefixes of one conversation, so a fresh context evaluates the longest one from
    position 0 in chunks that stop at each point a baseline needs: the start of the last user message
    (/edit: evaluate the edited message), the start of the last reply (/regen: the user message is in),
    the end of the checkpoint (cold resume: evaluate the next message). There the branch is evaluated and
    the first token sampled -- timed -- then the branch is truncated away and the pass goes on. The time to
    first token of a baseline = the pass's evaluation time up to that point + its branch: exactly what a
    fresh context evaluating those tokens from scratch does (only the 512-token batch boundaries after the
    first stop differ).
    """
    from chatcli.backends.llamacpp import Engine, Sampling

    eng = Engine(a["model_path"], n_ctx=a["n_ctx"], n_threads=a["threads"])
    tokens = list(a["tokens"])
    stops: list[tuple[int, int, str, str, list[int]]] = []
    for ck in a["checkpoints"]:
        assert tokens[:ck["n_tokens"]] == ck["tokens"], "checkpoints are not prefixes of one conversation"
        key = str(ck["target"])
        stops += [(ck["user_p0"], 0, key, "edit", ck["edit_tokens"]), (ck["reply_p0"], 1, key, "regen", []),
                  (ck["n_tokens"], 2, key, "cold", ck["next_tokens"])]
    stops.sort()
    sampling = Sampling(temperature=0.0)
    eng.eval(tokens[:8])  # warm-up (first-decode allocations), then an empty context again
    eng.clear()
    out: dict[str, dict[str, Any]] = {str(ck["target"]): {} for ck in a["checkpoints"]}
    main = 0.0
    for pos, _, key, kind, branch in stops:
        t = _pc()
        eng.eval(tokens[eng.n_past:pos])
        main += _pc() - t
        t = _pc()
        eng.eval(branch)
        gen = eng.generate(sampling, seed=1, max_tokens=4)
        next(gen)
        dt = _pc() - t
        gen.close()
        eng.truncate(pos)
        out[key][f"{kind}_ms"] = ms * (main + dt)
        out[key][f"{kind}_tokens"] = pos + len(branch)
    eng.close()
    return {"reingest": out}


def llama_state(a: dict[str, Any]) -> dict[str, Any]:
    """llama-cpp-python: read a saved ``LlamaState`` file, ``Llama.load_state``, then the first token."""
    from llama_cpp import Llama

    llm = Llama(model_path=a["model_path"], **llama_kwargs(a["n_ctx"], a["threads"]))
    t0 = _pc()
    state = read_llama_state(Path(a["path"]), llm.n_ctx())
    t_read = _pc()
    llm.load_state(state)
    t_restored = _pc()
    gen = llm.generate(list(a["tokens"]) + list(a["next_tokens"]), temp=0.0)
    next(gen)
    t_first = _pc()
    gen.close()
    return {"ttft_ms": ms * (t_first - t0), "restore_ms": ms * (t_restored - t0), "read_ms": ms * (t_read - t0)}


def llama_diskcache(a: dict[str, Any]) -> dict[str, Any]:
    """llama-cpp-python: ``LlamaDiskCache`` hit inside ``create_completion`` (unpickle + load_state + eval)."""
    from llama_cpp import Llama
    from llama_cpp.llama_cache import LlamaDiskCache

    class TimedCache(LlamaDiskCache):
        get_s = 0.0

        def __getitem__(self, key: Any) -> Any:
            t = _pc()
            try:
                return super().__getitem__(key)
            finally:
                self.get_s += _pc() - t

    llm = Llama(model_path=a["model_path"], **llama_kwargs(a["n_ctx"], a["threads"]))
    cache = TimedCache(cache_dir=a["cache_dir"], capacity_bytes=1 << 40)
    llm.set_cache(cache)
    loads = {"n": 0, "s": 0.0}
    orig_load = llm.load_state

    def timed_load(state: Any) -> None:
        t = _pc()
        orig_load(state)
        loads["n"] += 1
        loads["s"] += _pc() - t

    llm.load_state = timed_load  # type: ignore[method-assign]
    t0 = _pc()
    it = llm.create_completion(list(a["tokens"]) + list(a["next_tokens"]), max_tokens=4, temperature=0.0, stream=True)
    next(iter(it))
    t_first = _pc()
    return {"ttft_ms": ms * (t_first - t0), "restore_ms": ms * (cache.get_s + loads["s"]), "hit": loads["n"] == 1}


# -- /regen and /edit vs re-ingesting -------------------------------------------------------------------------


def rollback(a: dict[str, Any]) -> dict[str, Any]:
    """Per checkpoint and rep: chatcli's /regen, then /edit of the last message, each to its first new token."""
    from bench.common import make_paths
    from chatcli.core.files.store import ConversationStore

    out: dict[str, Any] = {}
    session = build_session(a["checkpoints"][0]["home"], model=a["model"], n_ctx=a["n_ctx"], threads=a["threads"],
                            max_tokens=16)
    for ck in a["checkpoints"]:
        # Each checkpoint is its own CHATCLI_HOME copy: point the session's store at it (same engine).
        session.paths = make_paths(ck["home"])
        session.store = ConversationStore(session.paths.conversations_dir)
        rows: dict[str, list[float]] = {"regen_ms": [], "edit_ms": []}
        for _ in range(a["reps"]):
            conv, report, _, _ = drain(session.open_conversation(ck["conv_id"]))
            assert report.reevaluated == 0, report.reason
            t0 = _pc()
            t1, _ = first_token(conv, conv.regen())
            rows["regen_ms"].append(ms * (t1 - t0))
            t0 = _pc()
            t1, _ = first_token(conv, conv.edit(None, EDIT_MSG))
            rows["edit_ms"].append(ms * (t1 - t0))
            conv.close()
        out[str(ck["target"])] = rows
    return {"rollback": out}


# -- throughput: chatcli's engine vs a bare llama-cpp-python loop on the same context -----------------------


def _bare_context(model_path: str, n_ctx: int, threads: int, n_batch: int,
                  flash_attn: bool = False) -> tuple[Any, Any, Any]:
    """A llama.cpp context with exactly the parameters chatcli's Engine uses (f16; ``flash_attn``: what the
    engine would be with flash attention for f16, bench.kv_layout)."""
    import llama_cpp

    mparams = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(model_path.encode(), mparams)
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = n_ctx
    cp.n_batch = n_batch
    cp.n_ubatch = n_batch
    cp.n_seq_max = 2
    cp.kv_unified = True
    cp.n_threads = threads
    cp.n_threads_batch = threads
    cp.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                          else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    cp.type_k = llama_cpp.GGML_TYPE_F16
    cp.type_v = llama_cpp.GGML_TYPE_F16
    cp.no_perf = True
    ctx = llama_cpp.llama_init_from_model(model, cp)
    batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
    return model, ctx, batch


def throughput(a: dict[str, Any]) -> dict[str, Any]:
    import llama_cpp

    from chatcli.backends.llamacpp import Engine, Sampling

    eng = Engine(a["model_path"], n_ctx=a["n_ctx"], n_threads=a["threads"])
    model, ctx, batch = _bare_context(a["model_path"], a["n_ctx"], a["threads"], eng.n_batch)
    mem = llama_cpp.llama_get_memory(ctx)
    text = " ".join(PARAGRAPHS) * 20
    prompt = eng.tokenize(text, add_special=False)[: a["prompt_tokens"]]
    assert len(prompt) == a["prompt_tokens"], "prompt text too short"
    count_prompt = eng.tokenize("<|im_start|>user\nCount from 1 to 1000, separated by commas.<|im_end|>\n"
                                "<|im_start|>assistant\n1, 2, 3, 4, 5,", add_special=False)
    greedy = Sampling(temperature=0.0, repeat_penalty=1.0)

    on_compute = compute_runner()  # the bare loop decodes on the engine's compute thread too

    def bare_decode() -> int:
        return int(on_compute(llama_cpp.llama_decode, ctx, batch))

    def bare_eval(tokens: list[int], start: int = 0) -> None:
        done = 0
        while done < len(tokens):
            part = tokens[done:done + eng.n_batch]
            batch.n_tokens = len(part)
            for i, tok in enumerate(part):
                batch.token[i] = tok
                batch.pos[i] = start + done + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = i == len(part) - 1 and done + len(part) == len(tokens)
            if bare_decode() != 0:
                raise RuntimeError("bare llama_decode failed")
            done += len(part)

    def clocks() -> tuple[float, float]:
        # Wall time, and this process's CPU time (all threads): on a busy machine the wall clock also counts
        # the time other processes held the cores, CPU time only the work done.
        return _pc(), time.process_time()

    def timed(fn: Callable[[], Any]) -> tuple[float, float]:
        w, c = clocks()
        fn()
        w2, c2 = clocks()
        return w2 - w, c2 - c

    def prompt_pair(chatcli_first: bool) -> tuple[tuple[float, float], tuple[float, float]]:
        """Both contexts evaluate the prompt from empty, in chunks of ``prompt_chunk`` tokens taken in turn
        (so both see the same machine load). Returns (chatcli wall, cpu), (bare wall, cpu)."""
        eng.clear()
        llama_cpp.llama_memory_clear(mem, True)
        tot = {"chatcli": [0.0, 0.0], "bare": [0.0, 0.0]}
        step = a["prompt_chunk"]
        for i in range(0, len(prompt), step):
            part = prompt[i:i + step]
            # Bound now: each lambda runs in this same iteration, but say so rather than rely on it.
            sides = [("chatcli", lambda part=part: eng.eval(part)), ("bare", lambda part=part, i=i: bare_eval(part, start=i))]
            for name, fn in (sides if chatcli_first else sides[::-1]):
                w, c = timed(fn)
                tot[name][0] += w
                tot[name][1] += c
        return (tot["chatcli"][0], tot["chatcli"][1]), (tot["bare"][0], tot["bare"][1])

    def decode_pair(chatcli_first: bool) -> tuple[list[float], list[float], int]:
        """Greedy decoding on both contexts, one token each in turn, so both see the same machine load.

        chatcli: each ``next()`` of ``Engine.generate`` samples (from its own copy of the logits) and decodes
        the previous token; the call that ends the generator decodes the last one. Bare: sample with
        ``llama_sampler_sample`` + ``llama_decode``. Returns (chatcli wall, cpu), (bare wall, cpu), tokens.
        """
        eng.clear()
        eng.eval(count_prompt)
        llama_cpp.llama_memory_clear(mem, True)
        bare_eval(count_prompt)
        smpl = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        llama_cpp.llama_sampler_chain_add(smpl, llama_cpp.llama_sampler_init_greedy())
        gen = eng.generate(greedy, seed=1, max_tokens=a["decode_tokens"])
        pos = len(count_prompt)
        c_tot = [0.0, 0.0]
        b_steps: list[tuple[float, float]] = []
        n = 0
        done = False

        def c_step() -> None:
            nonlocal n, done
            w, c = clocks()
            try:
                next(gen)
                n += 1
            except StopIteration:
                done = True
            w2, c2 = clocks()
            c_tot[0] += w2 - w
            c_tot[1] += c2 - c

        def b_step() -> None:
            nonlocal pos
            w, c = clocks()
            tok = llama_cpp.llama_sampler_sample(smpl, ctx, -1)
            batch.n_tokens = 1
            batch.token[0] = tok
            batch.pos[0] = pos
            batch.n_seq_id[0] = 1
            batch.seq_id[0][0] = 0
            batch.logits[0] = True
            if bare_decode() != 0:
                raise RuntimeError("bare llama_decode failed")
            pos += 1
            w2, c2 = clocks()
            b_steps.append((w2 - w, c2 - c))

        while not done:
            if chatcli_first:
                c_step()
                if not done:
                    b_step()
            else:
                b_step()
                c_step()
        llama_cpp.llama_sampler_free(smpl)
        b_steps = b_steps[:n]  # a bare step taken before chatcli's generator said it was over does not count
        return c_tot, [sum(x[0] for x in b_steps), sum(x[1] for x in b_steps)], n

    res: dict[str, list[float]] = {k: [] for k in (
        "chatcli_prompt_tps", "bare_prompt_tps", "chatcli_prompt_cpu_tps", "bare_prompt_cpu_tps",
        "chatcli_decode_tps", "bare_decode_tps", "chatcli_decode_cpu_tps", "bare_decode_cpu_tps", "decode_n")}
    # Short warm-ups (first-decode allocations), then pairs whose order flips every time.
    eng.eval(prompt[:32])
    bare_eval(prompt[:32])
    for p in range(a["pairs"]):
        for name, (w, c) in zip(("chatcli", "bare"), prompt_pair(chatcli_first=p % 2 == 0), strict=True):
            res[f"{name}_prompt_tps"].append(len(prompt) / w)
            res[f"{name}_prompt_cpu_tps"].append(len(prompt) / c)
        (cw, cc), (bw, bc), n = decode_pair(chatcli_first=p % 2 == 0)
        res["chatcli_decode_tps"].append(n / cw)
        res["chatcli_decode_cpu_tps"].append(n / cc)
        res["bare_decode_tps"].append(n / bw)
        res["bare_decode_cpu_tps"].append(n / bc)
        res["decode_n"].append(n)
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    eng.close()
    res["prompt_tokens"] = [len(prompt)]
    return res


# -- memory: a bare llama-cpp-python chat of one message, for the RSS comparison ------------------------------


def llama_rss(a: dict[str, Any]) -> dict[str, Any]:
    from llama_cpp import Llama

    llm = Llama(model_path=a["model_path"], **llama_kwargs(a["n_ctx"], a["threads"]))
    out = llm.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=a["max_tokens"], temperature=0.0)
    return {"n_completion": out["usage"]["completion_tokens"]}


# -- persona prefix: new-conversation time to first token, prefix cache cold vs warm ------------------------


def persona(a: dict[str, Any]) -> dict[str, Any]:
    session = build_session(a["home"], model=a["model"], n_ctx=a["n_ctx"], threads=a["threads"], max_tokens=16,
                            persona="long")
    cache_dir = session.paths.prefix_cache_dir

    def one(cached: bool) -> tuple[float, int, bool]:
        if not cached and cache_dir.exists():
            shutil.rmtree(cache_dir)
        t0 = _pc()
        conv, _, _, notices = drain(session.new_conversation("long"))
        t1, _ = first_token(conv, conv.send("Hi! Where do I start?"))
        hit = any("from cache" in n.text for n in notices)
        n_prefix = len(conv.r.prefix_tokens)
        conv.close()
        return ms * (t1 - t0), n_prefix, hit

    # Warm-up: a few tokens through a fresh context, so no measured run pays first-decode allocations. The
    # first pair runs uncached first, which also leaves the cache entry the cached runs read.
    session.engine.eval(session.engine.tokenize("Hello there, how are you?"))
    session.engine.clear()
    res: dict[str, Any] = {"uncached_ms": [], "cached_ms": [], "hits": [], "misses": []}
    # Uncached runs evaluate the whole persona: they repeat reingest_reps times, cached ones reps times.
    for p in range(max(a["reps"], a["reingest_reps"])):
        pair = [c for c, k in ((False, a["reingest_reps"]), (True, a["reps"])) if p < k]
        for cached in (pair if p % 2 == 0 else pair[::-1]):
            dt, n_prefix, hit = one(cached)
            res["cached_ms" if cached else "uncached_ms"].append(dt)
            (res["hits"] if cached else res["misses"]).append(hit)
            res["prefix_tokens"] = n_prefix
    res["all_cached_hit"] = all(res["hits"]) and not any(res["misses"])
    return res


# -- start-up: where a whole `chatcli talk` / `chatcli resume` process spends its time to the first token ------


def startup(a: dict[str, Any]) -> dict[str, Any]:
    """The steps of a chatcli process, timed on the wall clock from the parent's spawn (``t_spawn``):
    interpreter start, imports (what the CLI imports to run a conversation), model identity (the GGUF
    header read), model load (llama.cpp), the conversation (new: persona prefix from the cache; resume: the
    state restore), then the first token of the reply to ``NEXT_MSG``."""
    t_top = _T_TOP
    import importlib

    try:  # the CLI the process imports; before the cli/ package (section 7's "before" tree) it was cli.py
        importlib.import_module("chatcli.cli.app")
    except ModuleNotFoundError:
        importlib.import_module("chatcli.cli")
    from chatcli.models.resolve import resolve_model
    from chatcli.session import Session  # noqa: F401  (imports the engine and llama_cpp)

    t_imports = time.time()
    env = {"CHATCLI_HOME": a["home"]}
    ref = resolve_model(a["model"], env=env)
    t_ident = time.time()
    session = build_session(a["home"], model=a["model"], n_ctx=a["n_ctx"], threads=a["threads"], max_tokens=4,
                            model_ref=ref)
    t_loaded = time.time()
    if a["kind"] == "talk":
        conv, report, _, _ = drain(session.new_conversation("alice"))
    else:
        conv, report, _, _ = drain(session.open_conversation(a["conv_id"]))
    t_conv = time.time()
    t_first_pc, _ = first_token(conv, conv.send(NEXT_MSG))
    t_first = time.time() - (time.perf_counter() - t_first_pc)
    conv.close()
    return {
        "interpreter_ms": ms * (t_top - a["t_spawn"]), "imports_ms": ms * (t_imports - t_top),
        "identity_ms": ms * (t_ident - t_imports), "model_load_ms": ms * (t_loaded - t_ident),
        "conversation_ms": ms * (t_conv - t_loaded), "first_token_ms": ms * (t_first - t_conv),
        "total_ms": ms * (t_first - a["t_spawn"]),
        "state_restore_ms": ms * report.seconds if report is not None else 0.0,
        "reevaluated": report.reevaluated if report is not None else 0,
    }


MODES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "build": build, "resume": resume, "reingest": reingest, "llama_state": llama_state, "llama_diskcache": llama_diskcache,
    "rollback": rollback, "throughput": throughput, "llama_rss": llama_rss, "persona": persona, "startup": startup,
}


def main() -> None:
    mode, arg = sys.argv[1], sys.argv[2]
    a = json.loads(Path(arg[1:]).read_text() if arg.startswith("@") else arg)
    emit(MODES[mode](a))


if __name__ == "__main__":
    os.environ.setdefault("GGML_BACKEND_DEVICE", "")
    main()
