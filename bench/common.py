"""Helpers shared by the benchmark's orchestrator (``run.py``) and its worker processes (``workers.py``).

Nothing here is part of chatcli: the benchmark drives chatcli only through its core API (``Session``,
``Conversation``, ``Engine``), the same way ``tests/drive.py`` does.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

RESULT_PREFIX = "BENCH_RESULT "

# The message sent after every resume/restore, the same for every method being compared.
NEXT_MSG = "Thanks. Now give me one practical tip for next week, in one sentence."
# The text /edit puts in place of the last user message.
EDIT_MSG = "Actually, forget that: what is the single most important thing to do first?"

# Varied paragraphs for the long user messages that grow a conversation to a target length quickly.
PARAGRAPHS = [
    "I keep a small vegetable garden behind the house: four raised cedar beds with tomatoes, basil, peppers and "
    "climbing beans. The soil is heavy clay that I have been improving with compost for three years.",
    "My neighbour suggested drip irrigation on a timer instead of watering by hand every morning before work, "
    "but I worry about the cost of the kit and about the lines clogging with our hard water.",
    "Last summer the tomatoes split after a week of heavy rain that followed a long dry spell, and the basil "
    "bolted early even though I pinched the flowers off twice a week.",
    "I also started a compost heap from kitchen scraps, coffee grounds, cardboard and grass clippings. It smells "
    "sour sometimes and takes far longer to break down than the books promise.",
    "The beans did very well, but aphids covered the young shoots in June. I sprayed soapy water and the "
    "ladybirds arrived a week later; I am not sure which of the two actually helped.",
    "Next year I would like to add a fifth bed for root vegetables such as carrots, beetroot and parsnips, which "
    "need deep loose soil with no stones, so I am thinking about how to fill it.",
    "Our winters are mild and wet, with a few frosty nights in January. I have read about cover crops like "
    "clover and winter rye that protect the soil and add nitrogen when they are dug in.",
    "A friend gave me a rain barrel that holds about two hundred litres. It fills after a single storm, and I "
    "wonder whether a second barrel or a larger tank would be worth the trouble.",
    "The peppers ripened very late, and many stayed green until the first cold nights. Someone told me to start "
    "the seeds indoors in February under a lamp rather than buying young plants in May.",
    "I keep notes in a paper notebook: sowing dates, varieties, the weather and what went wrong. I would like a "
    "simple system to plan crop rotation over the next four years from these notes.",
    "Slugs are my biggest problem in spring. Beer traps catch a few, copper tape did nothing, and I do not want "
    "to use pellets because hedgehogs and birds visit the garden every evening.",
    "Finally, I want to grow enough herbs to dry for the winter: thyme, oregano, sage and mint, the last one in "
    "a pot so that it does not take over the beds as it did at my parents' house.",
]

PERSONA_FACTS = [
    "You are Sage, a patient and precise assistant for people who garden in small spaces.",
    "You answer in short paragraphs, never more than five sentences unless the user asks for detail.",
    "You prefer organic methods and explain the reason behind every recommendation.",
    "When you are not sure, you say so and suggest how the user could find out, for example with a soil test.",
    "You know the common vegetables of temperate climates: their spacing, sowing times and typical pests.",
    "You always consider the user's climate, soil type, budget and the time they have each week.",
    "You recommend compost, mulch and crop rotation before any purchased fertiliser or pesticide.",
    "You treat wildlife such as hedgehogs, birds, frogs and pollinating insects as allies in the garden.",
    "You avoid jargon; when a technical word is needed you explain it in a few plain words.",
    "You give quantities in metric units and mention the imperial equivalent when it helps.",
    "You remind users to wear gloves when handling manure, and to wash vegetables before eating them.",
    "You never invent product names, prices or studies; you speak about methods, not brands.",
]


def emit(result: dict[str, Any]) -> None:
    """A worker's answer: one JSON line on stdout, after whatever llama.cpp printed."""
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()


def make_paths(home: str | Path) -> Any:
    from chatcli.config.settings import get_paths

    return get_paths({"CHATCLI_HOME": str(home)})


def build_session(home: str | Path, *, model: str | None, n_ctx: int, threads: int, max_tokens: int,
                  persona: str = "alice", reserve: int = 256, model_ref: Any = None) -> Any:
    """A chatcli Session rooted at ``home`` with greedy decoding (what ``chatcli talk --temperature 0`` builds)."""
    from chatcli.models.resolve import resolve_model
    from chatcli.session import Session

    paths = make_paths(home)
    flags = {"temperature": 0.0, "seed": 1234, "n_ctx": n_ctx, "reserve": reserve, "max_tokens": max_tokens,
             "persona": persona, "threads": threads, "model": model}
    env = {"CHATCLI_HOME": str(home)}
    try:
        from chatcli.config.settings import load_settings_explicit
    except ImportError:  # chatcli before #12 (the --before tree of bench/run.py)
        from chatcli.config.settings import load_settings

        settings = load_settings(flags, paths=paths, env=env)
        explicit = {k for k, v in flags.items() if v is not None}
    else:
        settings, explicit = load_settings_explicit(flags, paths=paths, env=env)
    ref = model_ref if model_ref is not None else resolve_model(model, env=env)
    return Session.build(settings, paths, model=ref, explicit=explicit)


def drain(gen: Iterable[Any]) -> tuple[Any, Any, list[Any], list[Any]]:
    """Run a chatcli opening or event generator to its end: (conversation, resume report, reply ends, notices)."""
    try:
        from chatcli.core.steps import drain as core_drain
    except ImportError:  # chatcli before #25 had no drain of its own: the loops below
        pass
    else:
        done = core_drain(gen)
        return done.conversation, done.report, done.ends, done.notices
    try:
        from chatcli.core import opening
        from chatcli.core.events import Notice, ReplyEnd
    except ImportError:  # chatcli before #12 (the --before tree of bench/run.py)
        return _drain_old(gen)
    events: Iterable[Any] = gen
    box: Any = None
    if hasattr(opening, "split_opening"):  # chatcli before #25: openings were a mixed stream
        events, box = opening.split_opening(gen)
    seen = [ev for ev in events if isinstance(ev, (ReplyEnd, Notice))]
    ends = [ev for ev in seen if isinstance(ev, ReplyEnd)]
    notices = [ev for ev in seen if isinstance(ev, Notice)]
    if box is not None:
        return box.conversation, box.report, ends, notices
    if isinstance(gen, getattr(opening, "Opening", ())):
        return gen.conversation, gen.report, ends, notices
    return None, None, ends, notices


def _events(*names: str) -> list[Any]:
    """Event classes from ``chatcli.core.events``, or from ``core.conversation`` in trees older than it
    (the --before trees of bench/run.py)."""
    try:
        from chatcli.core import events as mod
    except ImportError:
        from chatcli.core import conversation as mod
    return [getattr(mod, n) for n in names]


def _drain_old(gen: Iterator[Any]) -> tuple[Any, Any, list[Any], list[Any]]:
    from chatcli.core.conversation import Conversation

    Notice, ReplyEnd, ResumeReport = _events("Notice", "ReplyEnd", "ResumeReport")
    conv = report = None
    ends: list[Any] = []
    notices: list[Any] = []
    for ev in gen:
        if isinstance(ev, Conversation):
            conv = ev
        elif isinstance(ev, ResumeReport):
            report = ev
        elif isinstance(ev, ReplyEnd):
            ends.append(ev)
        elif isinstance(ev, Notice):
            notices.append(ev)
    return conv, report, ends, notices


def first_token(conv: Any, gen: Iterator[Any]) -> tuple[float, Any]:
    """Consume a reply until its first token shows, cancel the rest; returns (perf_counter at that token, end).

    Cancelling through ``conv.cancel()`` is chatcli's own Ctrl-C path: the (one- or two-token) reply is
    still recorded, so the conversation stays consistent for the next measurement.
    """
    ReplyEnd, ReplyText = _events("ReplyEnd", "ReplyText")
    t_first = 0.0
    end = None
    for ev in gen:
        if isinstance(ev, ReplyText) and not t_first:
            t_first = time.perf_counter()
            conv.cancel()
        elif isinstance(ev, ReplyEnd):
            end = ev
    if not t_first:  # the first token printed nothing (e.g. end of turn straight away)
        t_first = time.perf_counter()
    return t_first, end


def dir_bytes(path: str | Path) -> int:
    """Bytes of the files under ``path``, each inode once (as ``du``: chatcli's forks hard-link their
    parent's state file instead of copying it)."""
    seen: dict[tuple[int, int], int] = {}
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                st = os.stat(os.path.join(root, f))
            except OSError:
                continue
            seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def llama_kwargs(n_ctx: int, threads: int) -> dict[str, Any]:
    """llama-cpp-python ``Llama`` settings matching chatcli's context (batch, KV types, no flash attention)."""
    import llama_cpp

    return dict(n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads, n_threads_batch=threads,
                type_k=llama_cpp.GGML_TYPE_F16, type_v=llama_cpp.GGML_TYPE_F16, flash_attn=False,
                verbose=False, seed=1234)


# -- llama-cpp-python LlamaState on disk, without pickle -----------------------------------------------------

_LS_MAGIC = b"BLS1"


def write_llama_state(path: Path, state: Any) -> int:
    """Serialize a ``LlamaState``: a JSON header, the token ids, then llama.cpp's state bytes.

    ``state.scores`` is not stored: with ``logits_all=False`` (the default) llama-cpp-python never writes
    those rows (sampling reads the context's own logits), so they carry no information.
    """
    import numpy as np

    n = int(state.n_tokens)
    ids = np.asarray(state.input_ids[:n], dtype="<i4").tobytes()
    head = json.dumps({"n_tokens": n, "seed": int(state.seed), "llama_state_size": int(state.llama_state_size),
                       "scores_shape": list(state.scores.shape)}).encode()
    with open(path, "wb") as fh:
        fh.write(_LS_MAGIC + len(head).to_bytes(4, "little") + head + ids)
        fh.write(state.llama_state)
        fh.flush()
        os.fsync(fh.fileno())
    return path.stat().st_size


def read_llama_state(path: Path, n_ctx: int) -> Any:
    import numpy as np
    from llama_cpp.llama import LlamaState

    with open(path, "rb") as fh:
        data = fh.read()
    if data[:4] != _LS_MAGIC:
        raise ValueError("not a benchmark LlamaState file")
    hlen = int.from_bytes(data[4:8], "little")
    head = json.loads(data[8:8 + hlen])
    n = int(head["n_tokens"])
    off = 8 + hlen
    ids = np.zeros(n_ctx, dtype=np.intc)
    ids[:n] = np.frombuffer(data[off:off + 4 * n], dtype="<i4")
    blob = data[off + 4 * n:]
    scores = np.zeros(tuple(head["scores_shape"]), dtype=np.single)
    return LlamaState(input_ids=ids, scores=scores, n_tokens=n, llama_state=blob,
                      llama_state_size=int(head["llama_state_size"]), seed=int(head["seed"]))


def compute_runner() -> Callable[..., Any]:
    """``COMPUTE.run`` of the chatcli being measured, or a plain call for a tree from before it had one.

    A harness that decodes with llama_cpp in the process chatcli decodes in must do it on chatcli's compute
    thread: a second thread starting OpenMP teams makes libgomp throttle the spinning of both
    (chatcli/backends/compute.py), and the comparison would be between two slowed loops.
    """
    try:
        from chatcli.backends.compute import COMPUTE
    except ImportError:
        return lambda fn, *args: fn(*args)
    return COMPUTE.run
