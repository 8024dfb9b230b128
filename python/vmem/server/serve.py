"""Running a server under uvicorn: the listening socket bound before anything loads (a port in
use fails in a moment, not after minutes of loading), SIGTERM and SIGINT draining the requests in
flight and then exiting 0, and one model's server (:func:`serve_one`: ``vmem-serve`` with one
model, and each model process of the router).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
from typing import Any, Iterator

from .._vmem import InvalidArgument
from .options import ServerOptions

PROG = "vmem-serve"
#: Exit status of a usage error.
USAGE = 2


def bind(opts: ServerOptions) -> socket.socket:
    """The listening socket, bound now (not yet listening): a port in use fails before loading."""
    if opts.uds is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(opts.uds)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(opts.uds)
        os.chmod(opts.uds, 0o600)
        return sock
    infos = socket.getaddrinfo(opts.host, opts.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.bind(address)
    return sock


def url_of(sock: socket.socket, opts: ServerOptions) -> str:
    if opts.uds is not None:
        return f"unix:{opts.uds}"
    host, port = sock.getsockname()[:2]
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def make_server(app: Any, opts: ServerOptions, access_log: bool, on_ready: Any, on_deadline: Any = None) -> Any:
    """A uvicorn server for ``app`` whose SIGTERM and SIGINT drain, then return (uvicorn's own
    handler raises the signal again after the drain, which would end the process with the
    signal's status, not 0); ``on_ready()`` runs once it accepts connections, ``on_deadline()``
    (on the event loop) when ``--drain-timeout`` seconds of draining passed, so requests still in
    flight can be answered (503) before uvicorn cancels what is left. Its ``exit_code`` is what
    the process should exit with."""
    import asyncio

    import uvicorn

    class _Server(uvicorn.Server):
        exit_code = 0

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            server: Any = self  # uvicorn's fields (typed Any where uvicorn is not installed)

            loop = asyncio.get_running_loop()

            def handle(sig: int, frame: Any) -> None:
                if server.should_exit and sig == signal.SIGINT:
                    server.force_exit = True  # a second Ctrl-C: stop waiting
                if not server.should_exit and on_deadline is not None:
                    loop.call_soon_threadsafe(loop.call_later, opts.drain_timeout, on_deadline)
                server.should_exit = True

            previous = {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, h in previous.items():
                    signal.signal(s, h)

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                on_ready()

    config = uvicorn.Config(app, log_level=opts.log_level, access_log=access_log, lifespan="on",
                            timeout_graceful_shutdown=int(opts.drain_timeout) + 5, timeout_keep_alive=30)
    return _Server(config)


def serve_one(opts: ServerOptions, access_log: bool) -> int:
    """One model in this process; the exit status."""
    from .app import make_app
    from .engine import Engine

    spec = opts.models[0]
    try:
        sock = bind(opts)
    except OSError as e:
        print(f"{PROG}: error: cannot listen on {opts.uds or f'{opts.host}:{opts.port}'}: {e.strerror or e}",
              file=sys.stderr)
        return 1
    engine = Engine(opts, spec)
    try:
        chosen = engine.prepare()
    except InvalidArgument as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sock.close()
        return USAGE
    except (OSError, ValueError) as e:
        print(f"{PROG}: error: cannot load {spec.path}: {e}", file=sys.stderr)
        sock.close()
        return 1
    try:
        engine.load(chosen)
    except Exception as e:  # noqa: BLE001 - whatever the load raised, said in one line
        print(f"{PROG}: error: cannot load {spec.path}: {type(e).__name__}: {e}", file=sys.stderr)
        sock.close()
        return 1
    app = make_app(engine)
    holder: dict = {}

    def died(why: str) -> None:
        server = holder.get("server")
        if server is not None:
            server.exit_code = 1
            server.should_exit = True

    engine.on_dead = died

    def ready() -> None:
        print(f"{PROG}: ready at {url_of(sock, opts)} (model {spec.name})", file=sys.stderr, flush=True)

    server = make_server(app, opts, access_log, ready, lambda: engine.abort("the drain timeout passed"))
    holder["server"] = server
    server.run(sockets=[sock])
    if opts.uds is not None:
        with contextlib.suppress(OSError):
            os.unlink(opts.uds)
    if server.force_exit:  # a second SIGINT: no drain, no lifespan shutdown; the engine stops now
        engine.close(timeout=2.0, hard=True)
        return 1
    return int(server.exit_code) or (0 if engine.dead is None else 1)
