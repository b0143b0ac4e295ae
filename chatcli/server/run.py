"""Start ``chatcli serve``: listen, load the model on a thread while the HTTP layer is imported and uvicorn
starts (503 ``Loading model`` until it is loaded), then serve until stopped."""

from __future__ import annotations

import ipaddress
import logging
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

from chatcli.config.settings import Paths, Settings
from chatcli.errors import ChatcliError
from chatcli.server import early_stop

# Imported here, before the loading thread starts, and not only for their types: the session imports
# llama_cpp and numpy (~0.2 s of Python holding the GIL), which the load needs first; the model then loads
# in llama.cpp's C code with the GIL released while the main thread imports the HTTP layer. Everything the
# loading thread runs is imported before it starts, so the two threads never import the same modules.
from chatcli.server.service import ChatService
from chatcli.session import Session


def _server_class(on_exit: Callable[[], None]) -> type:
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # Shut down as uvicorn does on SIGINT/SIGTERM, but without re-raising the signal once it has
            # stopped: replies cut by the shutdown must still be recorded (service.close) before we exit.
            # Running requests are told to stop first: uvicorn waits for them to end.
            on_exit()
            super().handle_exit(sig, frame)
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()

    return Server


class ApiKeysError(ChatcliError, ValueError):
    """The API keys cannot be used (an unreadable keys file, a short key): one line for the user."""

    kind = "usage"


def api_keys(settings: Settings, extra: Sequence[str] = ()) -> list[str]:
    """Every API key: ``api_key`` (setting, env or the first ``--api-key``), the further ``--api-key`` flags,
    then the lines of ``api_keys_file`` (blank lines and ``#`` comments skipped). Each is a client."""
    keys = [k for k in [settings.api_key, *extra] if k]
    if settings.api_keys_file:
        path = Path(settings.api_keys_file).expanduser()
        try:
            lines = path.read_text("utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ApiKeysError(f"cannot read the API keys file {path}: {getattr(exc, 'strerror', None) or exc}") from None
        keys += [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
    for n, k in enumerate(keys, start=1):
        if len(k.strip()) < 8 or any(c.isspace() for c in k.strip()):
            raise ApiKeysError(f"API key {n} must be at least 8 characters, without spaces")
    return list(dict.fromkeys(k.strip() for k in keys))


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """A line for a server that other machines can reach without a key (they could use the model and
    continue anyone's conversation by resending it)."""
    if api_key:
        return None
    try:
        loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback:
        return None
    return (f"listening on {host} without --api-key: anyone who can reach this port can use the model "
            "and the stored conversations; set --api-key (and put TLS in front on an untrusted network)")


def bind_address(host: str) -> tuple[socket.AddressFamily, str]:
    """The socket family and the address to bind for ``--host``: an IPv6 address may come in URL brackets
    (``[::1]``), which ``bind`` does not take."""
    bare = host.strip()
    if bare.startswith("[") and bare.endswith("]"):
        bare = bare[1:-1]
    return (socket.AF_INET6 if ":" in bare else socket.AF_INET), bare


def url_host(host: str) -> str:
    """``host`` as it is written in a URL (an IPv6 address in brackets)."""
    bare = bind_address(host)[1]
    return f"[{bare}]" if ":" in bare else bare


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` and listening: done first, so a port in use (not allowed, no such
    address) is one line before anything loads, and clients that connect while the model loads wait in
    the backlog for the server's 503 instead of being refused."""
    family, bare = bind_address(host)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((bare, port))
        sock.listen(2048)  # uvicorn's default backlog
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


class Loading:
    """The session and the service, built on a thread: the model loads in llama.cpp's C code with the GIL
    released, so the main thread's start-up (the HTTP layer's imports, uvicorn) runs meanwhile. ``then``
    runs a callback once it is done, on the loading thread (at once if it already is)."""

    def __init__(self, build: Callable[[], ChatService]) -> None:
        self._build = build
        self._lock = threading.Lock()
        self._done = False
        self._then: Callable[[], None] | None = None
        self.service: ChatService | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="chatcli-serve-load", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.service = self._build()
        except BaseException as exc:  # raised by ``serve`` on the main thread, as if it had loaded there
            self.error = exc
        with self._lock:
            self._done = True
            then = self._then
        if then is not None:
            then()

    def then(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if not self._done:
                self._then = callback
                return
        callback()

    def wait(self) -> ChatService | None:
        """Wait for the end: the service, or None when the build failed (``error``)."""
        self._thread.join()
        return self.service


def serve(settings: Settings, paths: Paths, build: Callable[[], Session], keys: Sequence[str] = ()) -> int:
    """Run the server until it is stopped; ``build`` loads the session (on the loading thread), which is
    closed here. A session that fails to load stops the server and its error is raised here."""
    previous = early_stop.install()  # again, for callers that did not come through the entry point
    try:
        return _serve(settings, paths, build, keys)
    finally:
        early_stop.restore(previous)


def _serve(settings: Settings, paths: Paths, build: Callable[[], Session], keys: Sequence[str]) -> int:
    sock = listen_socket(settings.host, settings.port)
    warning = exposure_warning(settings.host, keys[0] if keys else None)
    if warning:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    # Before the loading thread starts: the service logs while it is built (a first index build says so).
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    loading = Loading(lambda: _service(build, settings))
    try:
        import uvicorn

        from chatcli.server.app import ServerLimits, create_app

        app = create_app(None, api_keys=keys, limits=ServerLimits(max_queue=settings.max_queue))
        config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning", access_log=False,
                                lifespan="off")
        server = _server_class(app.state.stop_requests)(config)

        def stop_early() -> None:
            server.should_exit = True  # uvicorn stops before or right after its start-up

        early_stop.on_stop(stop_early)

        def loaded() -> None:
            if loading.service is None or server.should_exit:
                server.should_exit = True  # a failed load ends the server; its error is raised below
                return
            app.state.loaded(loading.service)
            _banner(settings, loading.service, keys)

        loading.then(loaded)
        server.run(sockets=[sock])
    finally:
        sock.close()
        service = loading.wait()
        if service is not None:
            try:
                service.close()
            finally:
                service.session.close()
    if loading.error is not None:
        raise loading.error
    print("chatcli serve: stopped", file=sys.stderr, flush=True)
    return 0


def _service(build: Callable[[], Session], settings: Settings) -> ChatService:
    """The loading thread's work: the session (the model), its notices said, and the service over it."""
    session = build()
    try:
        for n in session.notices:
            print(f"warning: {n}", file=sys.stderr, flush=True)
        return ChatService(session, parallel=settings.parallel, repl_access=settings.api_repl_access)
    except BaseException:
        session.close()
        raise


def _banner(settings: Settings, service: ChatService, keys: Sequence[str]) -> None:
    eng = service.session.engine
    n_indexed = len(service.index)
    url = f"http://{url_host(settings.host)}:{settings.port}/v1"
    print(f"chatcli serve: {url} · model {service.model_id} ({service.model_name}) · "
          f"n_ctx {eng.n_ctx} · {settings.parallel} resident · {n_indexed} conversation{'' if n_indexed == 1 else 's'} indexed"
          + (f" · API key required ({len(keys)} client{'' if len(keys) == 1 else 's'})" if keys else ""),
          file=sys.stderr, flush=True)
