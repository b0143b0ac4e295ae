"""Start ``chatcli serve``: load the model once, build the service and the app, run uvicorn until stopped."""

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
from chatcli.session import Session


def _import_http_layer() -> None:
    try:
        import uvicorn  # noqa: F401

        import chatcli.server.app  # noqa: F401
    except Exception:  # imported again by serve(), which then says what is wrong
        pass


# `chatcli serve` imports this module before it loads the model, and the model loads in llama.cpp's C code
# with the GIL released: the HTTP layer's own imports (pydantic building the schemas' classes, ~0.3 s, a
# third of `serve` until /health at 10,000 conversations) run meanwhile in a thread instead of after it.
# Everything they import besides that layer (the session, the core) is already imported above.
_http_layer = threading.Thread(target=_import_http_layer, name="chatcli-serve-imports", daemon=True)
_http_layer.start()


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


def listen_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on (in use, not allowed, no such address), or None: checked
    before the model loads, so a port in use is said at once instead of after the loading. The test
    socket is bound as the server's will be, then closed."""
    family, bare = bind_address(host)
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((bare, port))
    except OSError as exc:
        return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


def serve(settings: Settings, paths: Paths, session: Session, keys: Sequence[str] = ()) -> int:
    import uvicorn

    _http_layer.join()
    from chatcli.server.app import ServerLimits, create_app
    from chatcli.server.service import ChatService

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    service = ChatService(session, parallel=settings.parallel, repl_access=settings.api_repl_access)
    app = create_app(service, api_keys=keys, limits=ServerLimits(max_queue=settings.max_queue))
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning", access_log=False,
                            lifespan="off")
    server = _server_class(app.state.stop_requests)(config)
    # Bind here, so a port in use is one clear error line (OSError) instead of uvicorn's exit.
    family, bare = bind_address(settings.host)
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((bare, settings.port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {settings.host}:{settings.port}: {exc.strerror}") from None
    warning = exposure_warning(settings.host, keys[0] if keys else None)
    if warning:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    eng = session.engine
    n_indexed = len(service.index)
    url = f"http://{url_host(settings.host)}:{settings.port}/v1"
    print(f"chatcli serve: {url} · model {service.model_id} ({service.model_name}) · "
          f"n_ctx {eng.n_ctx} · {settings.parallel} resident · {n_indexed} conversation{'' if n_indexed == 1 else 's'} indexed"
          + (f" · API key required ({len(keys)} client{'' if len(keys) == 1 else 's'})" if keys else ""),
          file=sys.stderr, flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        service.close()
        sock.close()
    print("chatcli serve: stopped", file=sys.stderr, flush=True)
    return 0


