"""A remote engine: llama.cpp's own ``llama-server``, driven over HTTP with the standard library only.

One backend drives one *slot* of one server (``id_slot``, default 0). How the Backend operations map
onto llama-server (checked against tools/server in the llama.cpp that llama-cpp-python 0.3.36 vendors):

- ``tokens`` is the conversation's logical sequence: the exact token ids the transcript holds. Every
  request sends them whole, as a token-id array, with ``cache_prompt``: the server compares them with
  what the slot holds, keeps the longest common prefix and evaluates only the rest. So whatever the
  slot holds (another client's prompt, a restart, a half-finished reply), what the model sees is always
  exactly ``tokens``; what the slot already holds only decides what it costs.
- ``eval_steps`` records the tokens; they are evaluated by the next request (the reply's, usually, so a
  turn is one round trip). A large batch (a rebuild, a long paste) is evaluated right away instead, with
  the server's prompt progress streamed back, so the user sees a progress bar rather than a long wait.
- ``generate`` streams ``POST /completion`` (SSE) with ``return_tokens`` and the sampling parameters
  spelled out (server-side defaults such as min_p or DRY would otherwise apply); sampling happens on the
  server (``caps.local_sampling`` is False). The reply's ``timings`` say how many prompt tokens were
  evaluated vs found in the slot (``GenerationResult.n_prompt_evaluated`` / ``n_prompt_cached``).
- ``truncate`` only shortens ``tokens``: the next request's prefix match drops the rest on the server —
  where its memory can drop a tail. A recurrent or hybrid model's (Mamba, Qwen3.5, Granite-4-H, LFM2...)
  cannot: the server then restores one of its in-RAM *context checkpoints* or, with none (after a restart
  or a slot restore, which clears them), evaluates the whole prompt again. Which kind of server this is is
  probed at start (``caps.truncate``, ``caps.restore_reuse``, see ``_probe_memory``); the state log then
  saves a slot file at each regenerate point where a restored one is of use.
- ``checkpoint(name, n)``: first make the slot hold exactly ``tokens[:n]`` (the last sampled token and
  the turn's closing tokens are still pending), then ``POST /slots/{id}?action=save`` with ``name.bin``,
  written by the server under its ``--slot-save-path``. ``restore_checkpoint``: ``action=restore``, then
  check the server's ``n_restored`` against the expected count. Even a wrong restore cannot corrupt the
  conversation: the restored file carries its own token ids, and the prefix match re-evaluates from the
  first difference.
- No cells, no logits, no shift: a context shift or a changed identity rebuilds from the token ids.
- Failures (unreachable, refused, died mid-reply, timeouts) raise ``BackendError`` with one line. A
  reply cut off mid-stream keeps the tokens it had delivered (they are in ``tokens``).

Nothing here prints: notices for the user (e.g. "no persistence on this server") are collected in
``notices`` for the front end to show.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import ssl
import threading
import time
import urllib.parse
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Mapping

from chatcli.core.backend import (
    BackendError,
    Capabilities,
    ContextFullError,
    GenerationResult,
    GrammarError,
    Logits,
    Sampling,
    TokenEvent,
)
from chatcli.units import counted

# The server samples a token after the prompt even with n_predict=0, and a seed of 0xFFFFFFFF means
# "random" to it (LLAMA_DEFAULT_SEED): seeds are folded below that.
_RANDOM_SEED = 0xFFFFFFFF
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,180}")


class ServerConnectionError(BackendError):
    """The server could not be reached, or went away during a request."""


@dataclass(frozen=True)
class ServerConfig:
    """Where the server is and how long to wait for it."""

    url: str
    slot: int = 0
    connect_timeout: float = 10.0  # seconds to open a connection
    read_timeout: float = 600.0  # seconds of silence tolerated while waiting for an answer or the next token
    api_key: str | None = None  # sent as a Bearer token (llama-server --api-key)


@dataclass
class ServerStats:
    """What the server reported for this backend's requests (for benchmarks and tests)."""

    requests: int = 0
    prompt_evaluated: int = 0
    prompt_cached: int = 0
    predicted: int = 0
    last_timings: dict[str, Any] = field(default_factory=dict)
    last_restore: dict[str, Any] = field(default_factory=dict)
    last_save: dict[str, Any] = field(default_factory=dict)
    last_settings: dict[str, Any] = field(default_factory=dict)  # the last reply's generation_settings


def parse_server_url(url: str) -> tuple[str, str, int, str]:
    """(scheme, host, port, path prefix) of ``http[s]://HOST[:PORT][/prefix]``; BackendError when malformed."""
    text = url.strip()
    if "://" not in text:
        text = "http://" + text
    try:
        parts = urllib.parse.urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise BackendError(f"bad server URL {url!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BackendError(f"bad server URL {url!r}: use http://HOST:PORT")
    if parts.query or parts.fragment:
        raise BackendError(f"bad server URL {url!r}: no query or fragment")
    return parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80), parts.path.rstrip("/")


class LlamaServerBackend:
    """One slot of a llama-server, as a Backend (see the module docstring for the mapping)."""

    n_batch = 512  # evaluations larger than this are sent at once, with progress

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.url = config.url
        self._scheme, self._host, self._port, self._prefix = parse_server_url(config.url)
        self._conn: http.client.HTTPConnection | None = None
        self._cancel = threading.Event()
        self.tokens: list[int] = []
        # How many leading tokens of ``tokens`` the slot is known to hold (a lower bound): decides when a
        # checkpoint must first flush, and lets a reply notice that the slot lost them (server restart).
        self._held = 0
        # The slot may hold tokens after ``tokens`` (a rollback, a reply cut off before its end, a cleared
        # sequence): then a save must first make it hold exactly ``tokens``, or it saves the rolled-back ones.
        self._beyond = True
        self._checkpoints: dict[str, tuple[int, ...]] = {}  # name -> the tokens it holds (saved/restored here)
        self._last_checkpoint: str | None = None
        self._eager_evaluated = 0
        self.notices: list[str] = []
        self._told: set[str] = set()
        self.stats = ServerStats()
        self._pieces: dict[int, bytes] = {}
        self._special: dict[int, bool] = {}
        self._eog: set[int] = set()

        health = self._request("GET", "/health", None, what="check the server")
        if health.get("status") not in (None, "ok"):
            raise BackendError(f"llama-server at {self.url} is not ready ({health.get('status')})")
        props = self._request("GET", "/props", None, what="read the server's properties")
        self.props = props
        try:
            models = self._request("GET", "/v1/models", None, what="read the model's metadata")
            meta = dict((models.get("data") or [{}])[0].get("meta") or {})
        except BackendError:
            meta = {}  # older servers: /props alone still identifies the model
        settings = props.get("default_generation_settings") or {}
        self.n_ctx = int(settings.get("n_ctx") or meta.get("n_ctx") or 0)
        if self.n_ctx <= 0:
            raise BackendError(f"llama-server at {self.url} did not report its context size")
        total_slots = int(props.get("total_slots") or 1)
        if not 0 <= config.slot < total_slots:
            raise BackendError(f"llama-server at {self.url} has {counted(total_slots, 'slot')}: "
                               f"slot {config.slot} does not exist")
        self.model_path = str(props.get("model_path") or "")
        self.chat_template: str = str(props.get("chat_template") or "")
        self._meta = meta
        self.n_vocab = int(meta.get("n_vocab") or 0)
        self._bos_text = str(props.get("bos_token") or "")
        self._eos_text = str(props.get("eos_token") or "")
        self._bos = self._single_token(self._bos_text)
        self._eos = self._single_token(self._eos_text)
        if self._eos >= 0:
            self._eog.add(self._eos)
        probe = self.tokenize("a", add_special=True)
        self._add_bos = self._bos >= 0 and len(probe) >= 2 and probe[0] == self._bos
        if self.n_vocab <= 0:
            self.n_vocab = max(self._bos, self._eos, *probe) + 1  # a lower bound is all that can be known
        persist = self._probe_slot_actions()
        # Only probed where it changes something: without slot files there is nothing to restore instead
        # of cutting back, and the probe would evict the prompt the slot caches (e.g. a persona prefix).
        memory = self._probe_memory() if persist else "attention"
        self.caps = Capabilities(cells=False, checkpoint=persist, logits=False, local_sampling=False, shift=False,
                                 truncate=memory == "attention", restore_reuse=memory != "sliding window",
                                 memory=memory, grammar=True)
        if not persist:
            self._tell("no-persistence", f"llama-server at {self.url} was started without --slot-save-path: "
                       "conversations work, but their context is not saved on the server (resume re-reads them)")

    # -- HTTP ---------------------------------------------------------------------------------------

    def _connect(self) -> http.client.HTTPConnection:
        if self._conn is None:
            if self._scheme == "https":
                self._conn = http.client.HTTPSConnection(
                    self._host, self._port, timeout=self.config.connect_timeout, context=ssl.create_default_context())
            else:
                self._conn = http.client.HTTPConnection(self._host, self._port, timeout=self.config.connect_timeout)
        return self._conn

    def _drop_connection(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except OSError:
                pass
            self._conn = None

    def _headers(self, body: bytes | None) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        return headers

    def _open(self, method: str, path: str, payload: Any, *, what: str) -> http.client.HTTPResponse:
        """Send a request and return the response once its status line arrived (its body unread)."""
        body = None if payload is None else json.dumps(payload).encode()
        for attempt in (0, 1):
            conn = self._connect()
            try:
                if conn.sock is None:
                    conn.connect()
                conn.sock.settimeout(self.config.read_timeout)
                conn.request(method, self._prefix + path, body=body, headers=self._headers(body))
                resp = conn.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as exc:
                # A kept-alive connection the server closed while we were idle: one fresh try. A request
                # the server never answered is safe to repeat (each one carries the whole sequence).
                self._drop_connection()
                if attempt == 0:
                    continue
                raise ServerConnectionError(f"llama-server at {self.url} closed the connection ({what}): {_why(exc)}") from None
            except TimeoutError:
                self._drop_connection()
                raise ServerConnectionError(f"llama-server at {self.url} did not answer within "
                                            f"{self.config.read_timeout:g} s ({what})") from None
            except (OSError, http.client.HTTPException) as exc:
                self._drop_connection()
                raise ServerConnectionError(f"cannot reach llama-server at {self.url} ({what}): {_why(exc)}") from None
            self.stats.requests += 1
            return resp
        raise AssertionError("unreachable")

    def _request(self, method: str, path: str, payload: Any, *, what: str) -> dict[str, Any]:
        resp = self._open(method, path, payload, what=what)
        try:
            raw = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            self._drop_connection()
            raise ServerConnectionError(f"llama-server at {self.url} went away ({what}): {_why(exc)}") from None
        if resp.will_close:
            self._drop_connection()
        data = _json_or_none(raw)
        if resp.status >= 400:
            raise _http_error(resp.status, data, raw, self.url, what)
        if not isinstance(data, (dict, list)):
            raise BackendError(f"llama-server at {self.url} sent an unreadable answer ({what})")
        return data if isinstance(data, dict) else {"list": data}

    def _stream(self, payload: dict[str, Any], *, what: str, cancellable: bool) -> Generator[dict[str, Any], None, None]:
        """POST /completion with stream=true; yields each event's JSON. Closing it aborts the request."""
        resp = self._open("POST", "/completion", payload, what=what)
        if resp.status >= 400:
            raw = resp.read()
            if resp.will_close:
                self._drop_connection()
            raise _http_error(resp.status, _json_or_none(raw), raw, self.url, what)
        finished = False
        try:
            data_lines: list[str] = []
            while True:
                if cancellable and self._cancel.is_set():
                    return
                try:
                    line = resp.readline()
                except TimeoutError:
                    raise ServerConnectionError(f"llama-server at {self.url} sent nothing for "
                                                f"{self.config.read_timeout:g} s ({what})") from None
                except (OSError, http.client.HTTPException) as exc:
                    raise ServerConnectionError(f"llama-server at {self.url} went away ({what}): {_why(exc)}") from None
                if not line:
                    raise ServerConnectionError(f"llama-server at {self.url} closed the connection before the end ({what})")
                text = line.decode("utf-8", errors="replace").rstrip("\r\n")
                if text.startswith("data:"):
                    data_lines.append(text[5:].lstrip(" "))
                    continue
                if text or not data_lines:
                    continue  # ":" keep-alive comments, other fields, stray blank lines
                event = _json_or_none("\n".join(data_lines).encode())
                data_lines = []
                if not isinstance(event, dict):
                    continue  # "[DONE]" of OpenAI-style streams
                if "error" in event:
                    raise _http_error(500, event, b"", self.url, what)
                yield event
                if event.get("stop") is True:
                    finished = True
                    return
        finally:
            if finished and not resp.will_close:
                try:
                    resp.read()  # the chunked terminator: the connection can be reused
                except (OSError, http.client.HTTPException):
                    self._drop_connection()
            else:
                # Abandoned (cancel, error, consumer gone): closing the socket tells the server to stop.
                resp.close()
                self._drop_connection()

    def _tell(self, key: str, text: str) -> None:
        if key not in self._told:
            self._told.add(key)
            self.notices.append(text)

    def take_notices(self) -> list[str]:
        out, self.notices = self.notices, []
        return out

    def _probe_slot_actions(self) -> bool:
        """Does the server allow slot save/restore? Probed with an invalid slot id: nothing is changed."""
        try:
            self._request("POST", "/slots/chatcli-probe?action=save", {"filename": "x"}, what="probe slot actions")
        except ServerConnectionError:
            raise
        except BackendError as exc:
            # 501 "This server does not support slots action": no --slot-save-path. 400 "Invalid slot ID":
            # the endpoint works. 404: a server that has no slot endpoints at all.
            return getattr(exc, "status", 0) == 400
        return True

    def _probe_memory(self) -> str:
        """What the slot's memory does, seen from outside (server-context.cpp, the prompt cache match):

        - "attention": a prompt that diverges from what the slot holds reuses their common prefix (the tail
          is dropped, llama_memory_seq_rm);
        - "recurrent or hybrid": it cannot drop a tail; without a context checkpoint in the server's RAM —
          none exist after a restart or a slot restore — the whole prompt is evaluated again ("forcing full
          prompt re-processing"), but a restored slot file is reused by a prompt that extends it;
        - "sliding window": not even that: after a restore the window's oldest cell sits exactly at the
          server's reuse threshold, so a restored file saves nothing (upstream llama.cpp #25913, #28194).

        Two 2-token prompts that share their first token, then, only if the second reused nothing, a 3-token
        prompt saved to ``chatcli-probe.bin``, restored and extended by one token. On any refusal: attention
        (today's behaviour: nothing extra is saved).
        """
        if self.n_vocab < 4:
            return "attention"
        try:
            self._probe_eval([0, 1])
            if self._probe_eval([0, 2]) > 0:
                return "attention"
            self._probe_eval([0, 1, 2])
            name = {"filename": "chatcli-probe.bin"}
            for action in ("save", "restore"):
                self._request("POST", f"/slots/{self.config.slot}?action={action}", name, what="probe the slot's memory")
            return "recurrent or hybrid" if self._probe_eval([0, 1, 2, 3]) > 0 else "sliding window"
        except ServerConnectionError:
            raise
        except BackendError:
            return "attention"

    def _probe_eval(self, prompt: list[int]) -> int:
        """Evaluate ``prompt`` (nothing generated); returns how many of its tokens the slot reused."""
        payload = self._completion(0, prompt)
        payload.update(self._sampling_fields(Sampling(temperature=0.0, repeat_penalty=1.0), 0))
        payload.update(stream=False, return_progress=False)
        data = self._request("POST", "/completion", payload, what="probe the slot's memory")
        return int((data.get("timings") or {}).get("cache_n", 0))

    # -- identity and vocabulary -----------------------------------------------------------------------

    def identity(self) -> dict[str, Any]:
        """The server's model and context size: a saved slot is only restored where these are equal."""
        return {
            "backend": "llama-server",
            "model": os.path.basename(self.model_path),
            "model_size": self._meta.get("size"),
            "n_params": self._meta.get("n_params"),
            "n_vocab": self._meta.get("n_vocab"),
            "ftype": self.props.get("model_ftype") or self._meta.get("ftype"),
            "n_ctx": self.n_ctx,
        }

    def _single_token(self, text: str) -> int:
        if not text:
            return -1
        toks = self.tokenize(text, add_special=False, parse_special=True)
        return toks[0] if len(toks) == 1 else -1

    def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = True) -> list[int]:
        data = self._request("POST", "/tokenize", {"content": text, "add_special": add_special,
                                                   "parse_special": parse_special}, what="tokenize")
        toks = data.get("tokens")
        if not isinstance(toks, list) or not all(isinstance(t, int) for t in toks):
            raise BackendError(f"llama-server at {self.url} sent a malformed tokenization")
        return [int(t) for t in toks]

    def pieces(self, tokens: Sequence[int]) -> list[bytes]:
        """The bytes of each token (special tokens rendered), in one request for the ones not yet known."""
        missing = sorted({int(t) for t in tokens if int(t) not in self._pieces})
        if missing:
            data = self._request("POST", "/tokenize", {"content": missing, "with_pieces": True}, what="read token pieces")
            for item in data.get("tokens") or []:
                piece = item.get("piece")
                self._pieces[int(item["id"])] = (
                    piece.encode("utf-8") if isinstance(piece, str) else bytes(int(b) & 0xFF for b in piece or []))
        return [self._pieces.get(int(t), b"") for t in tokens]

    def piece(self, token: int, *, special: bool = True) -> bytes:
        raw = self.pieces([token])[0]
        if special or not raw:
            return raw
        return b"" if self._is_special(token, raw) else raw

    def _is_special(self, token: int, raw: bytes) -> bool:
        """A control token prints as nothing without ``special``; seen from outside: its text only maps back
        to it when special tokens are parsed."""
        if token not in self._special:
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                self._special[token] = False
            else:
                self._special[token] = (self.tokenize(text, parse_special=True) == [token]
                                        and self.tokenize(text, parse_special=False) != [token])
        return self._special[token]

    def is_eog(self, token: int) -> bool:
        return token in self._eog

    @property
    def bos_token(self) -> int:
        return self._bos

    @property
    def eos_token(self) -> int:
        return self._eos

    @property
    def add_bos(self) -> bool:
        return self._add_bos

    @property
    def n_evaluated_total(self) -> int:
        """What the server reported evaluating for this backend: prompt tokens and generated ones."""
        return self.stats.prompt_evaluated + self.stats.predicted

    # -- evaluation --------------------------------------------------------------------------------

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def eval_steps(self, tokens: Sequence[int]) -> Iterator[tuple[int, int]]:
        """Append ``tokens``. Small batches ride along with the next request; a large one is evaluated now,
        yielding the server's own progress (done, total) over the part of the sequence it had to evaluate."""
        toks = [int(t) for t in tokens]
        if self.n_past + len(toks) > self.n_ctx:
            raise ContextFullError(f"{len(toks)} tokens do not fit: {self.n_past}/{self.n_ctx} in use")
        if any(not 0 <= t < self.n_vocab for t in toks):
            raise BackendError("token id outside the server model's vocabulary")
        self.tokens.extend(toks)
        if len(self.tokens) - self._held <= self.n_batch or len(self.tokens) >= self.n_ctx:
            yield len(toks), len(toks)
            return
        last = (0, 0)
        # A slot that cannot be cut back keeps the last token pending: a regenerate point (all but a user
        # message's last token) can only be saved while the slot has not gone past it.
        for last in self._flush(progress=True, n=len(self.tokens) - (0 if self.caps.truncate else 1)):
            yield last
        if last[0] < last[1] or last == (0, 0):
            yield len(toks), len(toks)

    def _sampling_fields(self, sampling: Sampling, seed: int) -> dict[str, Any]:
        """Every sampler spelled out: a server started with other defaults (--temp, --min-p, DRY, ...) must
        not change chatcli's replies. The chain is the local engine's (llamacpp.Engine._make_sampler):
        logit bias, then penalties, top-k, top-p, min-p, temperature, dist. The server puts the logit bias
        first by itself; its grammar is checked against the sampled token and, when that token does not
        fit, applied before the chain (the same token as the local grammar-first chain when greedy)."""
        greedy = sampling.temperature <= 0
        penalized = ((sampling.repeat_penalty and sampling.repeat_penalty != 1.0)
                     or sampling.frequency_penalty or sampling.presence_penalty)
        samplers = ["penalties"] if penalized else []
        if not greedy:
            samplers += ["top_k", "top_p"]
            if sampling.min_p > 0:
                samplers.append("min_p")
        samplers.append("temperature")
        return {
            "temperature": max(0.0, sampling.temperature), "top_k": sampling.top_k, "top_p": sampling.top_p,
            "min_p": sampling.min_p if not greedy else 0.0, "min_keep": 1, "typical_p": 1.0,
            "repeat_penalty": sampling.repeat_penalty or 1.0, "repeat_last_n": sampling.repeat_last_n,
            "presence_penalty": sampling.presence_penalty, "frequency_penalty": sampling.frequency_penalty,
            "dry_multiplier": 0.0, "xtc_probability": 0.0, "mirostat": 0, "dynatemp_range": 0.0,
            "logit_bias": self._logit_bias(sampling.logit_bias), "grammar": sampling.grammar,
            "samplers": samplers, "seed": (seed & 0xFFFFFFFF) % _RANDOM_SEED, "ignore_eos": False, "n_probs": 0,
        }

    def _logit_bias(self, bias: Sequence[tuple[int, float]]) -> list[list[Any]]:
        """[token, bias] pairs as the server reads them. It drops an id outside its vocabulary without a word,
        so that is refused here (as the local engine refuses it); -inf (a ban) has no JSON number: ``false``."""
        out: list[list[Any]] = []
        for tok, value in bias:
            if not 0 <= tok < self.n_vocab:
                raise BackendError(f"logit_bias: token {tok} is not in the vocabulary (0..{self.n_vocab - 1})")
            if math.isnan(value) or value == math.inf:
                raise BackendError(f"logit_bias: the bias of token {tok} must be a finite number or -inf")
            out.append([int(tok), False if value == -math.inf else float(value)])
        return out

    def _completion(self, n_predict: int, prompt: list[int]) -> dict[str, Any]:
        return {
            "prompt": prompt, "n_predict": n_predict, "cache_prompt": True, "id_slot": self.config.slot,
            "stream": True, "return_tokens": True, "return_progress": True, "n_keep": 0,
        }

    def _flush(self, *, progress: bool = False, n: int | None = None) -> Iterator[tuple[int, int]]:
        """Make the slot hold exactly ``tokens`` (its first ``n``; an n_predict=0 request); yields prompt
        progress. What the server evaluates is added to ``_eager_evaluated``: reported with the next reply."""
        upto = len(self.tokens) if n is None else n
        prompt = self.tokens[: min(upto, self.n_ctx - 1)]  # the server refuses a prompt that fills the context
        if not prompt or (self._held >= len(prompt) and not self._beyond):
            return
        payload = self._completion(0, prompt)
        payload.update(self._sampling_fields(Sampling(temperature=0.0, repeat_penalty=1.0), 0))
        final: dict[str, Any] = {}
        for ev in self._stream(payload, what="evaluate the conversation", cancellable=False):
            prog = ev.get("prompt_progress")
            if progress and isinstance(prog, dict):
                cache = int(prog.get("cache", 0))
                yield int(prog.get("processed", 0)) - cache, int(prog.get("total", 0)) - cache
            if ev.get("stop") is True:
                final = ev
        if not final:
            raise ServerConnectionError(f"llama-server at {self.url} stopped evaluating the conversation")
        self._note_timings(final)
        self._eager_evaluated += int((final.get("timings") or {}).get("prompt_n", 0))
        # n_predict=0 still samples one token after the prompt, but never decodes it: the slot holds the prompt.
        self._held = len(prompt)
        self._beyond = False

    def flush(self, n: int | None = None) -> int:
        """Make the slot hold exactly ``tokens`` (its first ``n``) now; returns the tokens the server evaluated
        for it (not reported with the next reply: the caller reports them)."""
        before = self._eager_evaluated
        for _ in self._flush(n=n):
            pass
        evaluated, self._eager_evaluated = self._eager_evaluated - before, before
        return evaluated

    def _note_timings(self, final: dict[str, Any]) -> None:
        timings = final.get("timings") or {}
        self.stats.last_timings = dict(timings)
        self.stats.last_settings = dict(final.get("generation_settings") or {})
        self.stats.prompt_evaluated += int(timings.get("prompt_n", 0))
        self.stats.prompt_cached += int(timings.get("cache_n", 0))
        self.stats.predicted += int(timings.get("predicted_n", 0))

    # -- generation ----------------------------------------------------------------------------------

    def json_grammar(self, schema: Mapping[str, Any] | None = None) -> str:
        """The local engine's JSON grammar (the same function builds it), sent as the request's ``grammar``.
        It is checked by llama.cpp's parser in this process (no vocabulary needed: it names no tokens), so a
        schema the server would refuse is refused before anything is written."""
        from chatcli.backends.llamacpp import json_gbnf  # loads llama.cpp: only when a grammar is asked for

        return json_gbnf(schema)

    def cancel(self) -> None:
        self._cancel.set()

    def reset_cancel(self) -> None:
        self._cancel.clear()

    def generate(
        self, sampling: Sampling, *, seed: int, max_tokens: int, result: GenerationResult | None = None,
        stop_strings: Sequence[str] = (), defer_last: bool = False,
    ) -> Iterator[TokenEvent]:
        """Stream a reply sampled by the server. Each token joins ``tokens`` before it is yielded
        (``defer_last`` changes nothing: the server evaluates what it sampled when the next request asks)."""
        res = result if result is not None else GenerationResult()
        t0 = time.perf_counter()
        prompt = list(self.tokens)
        if not prompt:
            raise BackendError("nothing to reply to: the sequence is empty")
        if len(prompt) >= self.n_ctx:
            res.stop_reason = "context"
            return
        payload = self._completion(max(1, min(max_tokens, self.n_ctx - len(prompt))), prompt)
        payload.update(self._sampling_fields(sampling, seed))
        text = b""
        final: dict[str, Any] = {}
        refused = False
        try:
            for attempt in (0, 1):
                restart = False
                stream = self._stream(payload, what="generate a reply", cancellable=True)
                try:
                    first_progress = True
                    for ev in stream:
                        prog = ev.get("prompt_progress")
                        if isinstance(prog, dict) and first_progress:
                            first_progress = False
                            if attempt == 0 and self._recoverable(int(prog.get("cache", 0)), prompt):
                                restart = True  # the slot lost our tokens: drop this request, restore, ask again
                                break
                        if ev.get("stop") is True:
                            final = ev
                        if isinstance(prog, dict):
                            continue  # progress events carry a placeholder token id (server-context.cpp)
                        new = [int(t) for t in ev.get("tokens") or []]
                        if not new:
                            continue
                        content = str(ev.get("content") or "").encode("utf-8")
                        got = self._received(res, new, content, int(ev.get("tokens_predicted") or 0))
                        for i, tok in enumerate(got):
                            piece = content if i == len(got) - 1 else b""
                            eog = tok in self._eog
                            if not res.tokens:
                                res.ttft = time.perf_counter() - t0
                            res.tokens.append(tok)
                            self.tokens.append(tok)
                            text += piece
                            yield TokenEvent(tok, b"" if eog else piece, eog, res.shown(time.perf_counter() - t0))
                        if stop_strings and any(s in text.decode("utf-8", "ignore") for s in stop_strings):
                            res.stop_reason = "stop"
                            return
                finally:
                    stream.close()
                if not restart:
                    break
                self._recover(prompt)
            if not final:
                if self._cancel.is_set():
                    res.stop_reason = "cancelled"
                    return
                raise ServerConnectionError(f"llama-server at {self.url} ended the reply without finishing it")
            self._note_timings(final)
            timings = final.get("timings") or {}
            res.n_prompt_evaluated = int(timings.get("prompt_n", 0)) + self._eager_evaluated
            res.n_prompt_cached = int(timings.get("cache_n", 0))
            self._eager_evaluated = 0
            stop_type = final.get("stop_type")
            if stop_type == "eos":
                res.stop_reason = "eog"
                if res.tokens:
                    self._eog.add(res.tokens[-1])  # learn the model's end-of-generation tokens as they come
            elif final.get("truncated"):
                res.stop_reason = "context"
            elif stop_type == "word":
                res.stop_reason = "stop"
            else:
                res.stop_reason = "length"
        except _HTTPStatusError as exc:
            if not (sampling.grammar and "grammar" in exc.detail):
                raise
            if exc.status == 400:
                # Refused before anything was evaluated (server-context.cpp launch_slot: "Failed to initialize
                # samplers"): the caller's input, one line, the slot as it was.
                refused = True
                raise GrammarError(f"llama-server cannot build a sampler for the grammar: {exc.detail}") from None
            # The grammar failed mid-reply (no token it allows, "Unexpected empty grammar stack"): the tokens
            # delivered so far are kept, as for any reply cut off.
            raise GrammarError(f"llama-server stopped the reply: {exc.detail}") from None
        finally:
            if not refused:
                # The slot holds the prompt and every delivered token but the last (sampled, never decoded);
                # after a cancel it may hold more, which the next prefix match trims.
                self._held = len(prompt) + max(0, len(res.tokens) - 1)
                self._beyond = not final  # left before its end: the server may have decoded more than it sent
            if not res.stop_reason:
                res.stop_reason = "cancelled"
            res.seconds = time.perf_counter() - t0
            res.n_decoded = len(res.tokens)
            self._cancel.clear()

    def _received(self, res: GenerationResult, new: list[int], content: bytes, predicted: int) -> list[int]:
        """The tokens an event stands for. The server streams a token only once its text is whole UTF-8,
        so a character split over several tokens arrives as one event naming only its last token; the
        ids before it are recovered by tokenizing the text (exact when the tokenizer agrees with the
        sampler; if not, the next request's prefix match re-evaluates from there: the slot never
        disagrees with ``tokens`` for long)."""
        missing = predicted - len(res.tokens) - len(new)
        if missing <= 0 or not content:
            return new
        try:
            redo = self.tokenize(content.decode("utf-8"), parse_special=False)
        except (UnicodeDecodeError, BackendError):
            return new
        if len(redo) >= 1 and redo[-1] == new[-1]:
            return redo
        return [*redo[:-1], new[-1]] if redo else new

    def _recoverable(self, cached: int, prompt: list[int]) -> bool:
        """The slot holds far less of ``prompt`` than it did (the server restarted, or another client took
        the slot) and this process saved a checkpoint of a longer prefix of it."""
        name = self._last_checkpoint
        if name is None or cached >= min(self._held, len(prompt) - 1):
            return False
        held = self._checkpoints.get(name, ())
        return len(held) > cached + 1 and tuple(prompt[: len(held)]) == held

    def _recover(self, prompt: list[int]) -> None:
        """Restore the last checkpoint into the slot (same model and context size only); on any failure the
        request is simply sent again and the server evaluates what it lacks."""
        name = self._last_checkpoint
        assert name is not None
        self._check_identity()
        try:
            self._restore(name, prompt[: len(self._checkpoints[name])])
        except ServerConnectionError:
            raise
        except BackendError:
            pass

    def _check_identity(self) -> None:
        before = self.identity()
        props = self._request("GET", "/props", None, what="read the server's properties")
        n_ctx = int((props.get("default_generation_settings") or {}).get("n_ctx") or 0)
        if os.path.basename(str(props.get("model_path") or "")) != before["model"] or n_ctx != self.n_ctx:
            raise BackendError(f"llama-server at {self.url} restarted with another model or context size: "
                               "reopen the conversation")

    # -- memory ------------------------------------------------------------------------------------

    def truncate(self, n: int) -> int:
        """Forget positions >= n. The server drops them at the next request (prefix match)."""
        if n < 0 or n > self.n_past:
            raise BackendError(f"cannot truncate to {n}: the sequence holds {self.n_past}")
        dropped = self.n_past - n
        del self.tokens[n:]
        self._held = min(self._held, n)
        self._beyond = self._beyond or dropped > 0
        return dropped

    def rewind(self, n: int, p0: int, data: bytes | memoryview) -> None:
        """The server keeps no saved cells of ours: a shorter sequence is a truncation it sees next time."""
        self.truncate(n)

    def shift(self, keep: int, drop: int) -> None:
        raise BackendError("llama-server sequences are not shifted from the client: the context is rebuilt")

    def clear(self) -> None:
        # The slot keeps its cells: a new sequence that starts the same way (the persona) reuses them.
        self.tokens = []
        self._held = 0
        self._beyond = True

    def forget(self) -> None:
        self.clear()  # the server takes up its slot's cached prompt itself

    def kept(self, tokens: Sequence[int]) -> int:
        return 0

    def take_kept(self, tokens: Sequence[int]) -> bool:
        return False

    # -- logits and cells: not available remotely --------------------------------------------------------

    @property
    def has_logits(self) -> bool:
        return False

    def logits(self) -> Logits:
        raise BackendError("llama-server does not hand out logits")

    def set_logits(self, logits: Logits) -> None:
        raise BackendError("llama-server does not take logits")

    def ensure_logits(self) -> int:
        return 0  # the server computes the last position's logits itself when it samples

    def save_cells(self, p0: int, p1: int, *, point: bool = True) -> bytes:
        raise BackendError("llama-server saves whole slots, not cell ranges")

    def load_cells(self, p0: int, p1: int, data: bytes | memoryview, tokens: Sequence[int]) -> None:
        raise BackendError("llama-server restores whole slots, not cell ranges")

    # -- checkpoints -----------------------------------------------------------------------------------

    @staticmethod
    def checkpoint_file(name: str) -> str:
        if not _NAME_RE.fullmatch(name):
            raise BackendError(f"bad checkpoint name {name!r}")
        return f"{name}.bin"

    def checkpoint(self, name: str, n: int | None = None) -> int:
        """Save the slot, holding exactly ``tokens`` (its first ``n``: the slot must not hold more of them yet,
        or a memory that cannot be cut back would evaluate them all again), as ``name.bin`` under the server's
        --slot-save-path. The end-of-turn flush (the last sampled token, the closing) is not counted as
        evaluated; a prefix's flush is (it reads the user's message, reported with the reply)."""
        filename = self.checkpoint_file(name)
        if not self.caps.checkpoint:
            return 0
        if not self.tokens:
            return 0
        upto = len(self.tokens) if n is None else n
        if not 0 < upto <= len(self.tokens):
            raise BackendError(f"cannot save the first {upto} tokens: the sequence holds {len(self.tokens)}")
        counted = self._eager_evaluated
        for _ in self._flush(n=upto):
            pass
        if n is None:
            self._eager_evaluated = counted
        data = self._request("POST", f"/slots/{self.config.slot}?action=save", {"filename": filename},
                             what="save the conversation's slot")
        self.stats.last_save = data
        n_saved = int(data.get("n_saved", -1))
        if n_saved != upto:
            # Another client used the slot between our two requests: the file does not hold our sequence.
            self._checkpoints.pop(name, None)
            raise BackendError(f"llama-server saved {n_saved} tokens instead of {upto}: "
                               f"is another client using slot {self.config.slot}?")
        self._checkpoints[name] = tuple(self.tokens[:upto])
        self._last_checkpoint = name
        return int(data.get("n_written", 0))

    def restore_checkpoint(self, name: str, tokens: Sequence[int]) -> bool:
        """Load ``name.bin`` into the slot; True when it holds as many tokens as ``tokens`` (then ``tokens``
        is the sequence). Missing file, another KV format, or another count: False, nothing changed here."""
        self.checkpoint_file(name)
        if not self.caps.checkpoint:
            return False
        toks = [int(t) for t in tokens]
        if not toks or len(toks) >= self.n_ctx:
            return False
        try:
            ok = self._restore(name, toks)
        except ServerConnectionError:
            raise
        except BackendError:
            return False
        if ok:
            self.tokens = toks
        return ok

    def _restore(self, name: str, toks: list[int]) -> bool:
        self._held = 0  # a failed restore leaves the slot empty (server-context.cpp: prompt_clear)
        self._beyond = False
        data = self._request("POST", f"/slots/{self.config.slot}?action=restore", {"filename": self.checkpoint_file(name)},
                             what="restore the conversation's slot")
        self.stats.last_restore = data
        n = int(data.get("n_restored", -1))
        if n != len(toks):
            return False
        self._held = n
        self._checkpoints[name] = tuple(toks)
        self._last_checkpoint = name
        return True

    def close(self) -> None:
        self._drop_connection()


class _HTTPStatusError(BackendError):
    def __init__(self, message: str, status: int, detail: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.detail = detail or message  # the server's own words


def _json_or_none(raw: bytes) -> Any:
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None


def _http_error(status: int, data: Any, raw: bytes, url: str, what: str) -> BackendError:
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):
        message = str(err.get("message") or err.get("type") or "")
        kind = str(err.get("type") or "")
        status = int(err.get("code") or status)
    else:
        message = raw.decode("utf-8", "replace").strip()[:200] if raw else ""
        kind = ""
    message = " ".join(message.split()) or f"HTTP {status}"
    if kind == "exceed_context_size_error":
        return ContextFullError(f"llama-server: {message}")
    if status == 401:
        return _HTTPStatusError(f"llama-server at {url} refused the API key ({what})", status)
    return _HTTPStatusError(f"llama-server at {url} could not {what}: {message}", status, message)


def _why(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
