"""`axon serve [MODEL]`: bind the port first, then load the startup models in the background.

Startup follows neuron: config (TOML, then `AXON_*`, then flags), the registry, the activation
tracker, the HTTP listener bound, and only then the `default_models` (and MODEL), one after
another, each failure recorded in `/health.activation` and skipped. On SIGTERM or SIGINT the
server stops admitting requests (503), gives the in-flight ones up to `shutdown_grace_s`, unloads
every model and exits 0. A second signal exits at once.

Heavy imports (uvicorn, the app, the engine) happen inside the functions, so `axon --help`
stays fast.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import socket
import sys

from axon.server import access_log
from axon.server.config import ServerConfig
from axon.server.errors import AxonHTTPError, ModelUnavailable
from axon.server.lifecycle.catalog import default_models_dirs
from axon.server.lifecycle.early_engine import spawn_first_model
from axon.server.lifecycle.multinode import multinode_args, multinode_starter, run_headless_node
from axon.server.lifecycle.on_demand import RequestScope
from axon.server.lifecycle.registry import ActivationTracker, ModelRegistry
from axon.server.serve_args import config_from_namespace, with_demo_default
from axon.server.state import AppState

logger = logging.getLogger("axon.serve")

OPEN_PATHS = ("/health", "/metrics")  # still answered while shutting down
KEEP_ALIVE_S = 75  # idle keep-alive connections (nginx's default)


def run_serve(ns: argparse.Namespace) -> int:
    """`axon serve`: runs until SIGTERM/SIGINT; returns the exit status (0 after a clean stop)."""
    from pydantic import ValidationError

    if ns.headless:
        code = run_headless_node(ns)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # no group teardown or exit handlers: node 0's side is gone or going
    try:
        config = config_from_namespace(ns)
    except ValidationError as exc:
        raise ValueError(str(exc)) from None
    multinode = multinode_args(ns)  # MODEL is default_models[0] when given
    starter = (
        multinode_starter(config.default_models[0].served_id, multinode) if multinode else None
    )
    config = with_demo_default(config, ns)
    if config.models_dirs is None:
        config = config.with_overrides(models_dirs=default_models_dirs(os.environ))
    config.check_model_aliases()  # before the first engine is spawned
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # Before the server stack (and torch) is imported: the engine loads meanwhile.
    early = spawn_first_model(config) if starter is None else None
    return asyncio.run(serve(config, hard_exit=True, starter=starter, early=early))


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 picks a free one. Raises OSError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say so, and
    # without it a keep-alive response can wait for the client's delayed ACK (Nagle). The
    # listener's own TCP_NODELAY is inherited by the connections it accepts (Linux).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # connections queue from here on, before uvicorn accepts them
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


class AdmissionGate:
    """ASGI wrapper: once the server is shutting down, new requests get a 503 (Retry-After),
    except the open paths. Requests already in flight are not touched."""

    def __init__(self, app, state):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.state.shutting_down or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        error = ModelUnavailable("the server is shutting down", headers={"Retry-After": "10"})
        body = json.dumps(error.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"retry-after", b"10")]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def load_default_models(registry, specs, tracker: ActivationTracker) -> None:
    """Loads `specs` one after another; a failure is recorded in `tracker` and skipped. Marks
    the tracker ready at the end."""
    for spec in specs:
        tracker.start(spec.served_id)
        try:
            await registry.load(spec, trusted=True)  # the operator's own: any local path
            registry.keep_spec(spec)  # axon may unload it when idle and load it again
        except AxonHTTPError as exc:
            logger.error("startup load of %s failed: %s", spec.served_id, json.dumps(exc.body()))
            tracker.finish(spec.served_id, error=exc.message)
        except Exception as exc:
            logger.exception("startup load of %s failed", spec.served_id)
            tracker.finish(spec.served_id, error=f"{type(exc).__name__}: {exc}")
        else:
            tracker.finish(spec.served_id)
    tracker.state = "ready"
    _keep_the_loop_responsive()
    logger.info("activation ready: %s", json.dumps(tracker.snapshot()))


def _keep_the_loop_responsive() -> None:
    """What keeps a big answer's work from stalling the event loop (docs/performance.md)."""
    # Modules, app and startup tokenizers live as long as the process: out of the cyclic GC,
    # whose full passes (holding the GIL, so stalling the loop) walk only what requests made.
    gc.freeze()
    # After freeze() CPython's rule that holds a full pass back until gen 2 grew by a quarter
    # counts only unfrozen objects, so it held nothing back: a 55 MB answer's in-flight objects
    # were walked 32 times (up to 45 ms each); a full pass every 100 gen-1 passes, not 10: 3.
    gc.set_threshold(*gc.get_threshold()[:2], 100)
    # A pool thread building a big body yields the GIL to the waiting loop after 1 ms, not 5:
    # a /health probe waits for it several times; p99 ~65 ms -> 20-30 ms during a 55 MB answer.
    sys.setswitchinterval(0.001)


def _make_server(config: ServerConfig, state):
    import uvicorn

    # lazy: fastapi, uvicorn and the routes load to serve, not for `axon --help`
    from axon.server.app import create_app
    from axon.server.edge import BodyLimits, guarded_protocol  # lazy: uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # serve() owns SIGTERM/SIGINT: drain models first
            yield

    app = AdmissionGate(RequestScope(create_app(state)), state)
    app = BodyLimits(app, config.max_request_body_bytes, config.request_body_timeout_s)
    linger_bytes = 4 * config.max_request_body_bytes  # discarded after an early answer
    protocol = guarded_protocol(
        config.request_header_timeout_s, config.max_connections, linger_bytes
    )
    uv_config = uvicorn.Config(
        app,
        http=protocol,
        log_level=config.log_level.lower(),
        timeout_graceful_shutdown=max(1, int(config.shutdown_grace_s)),
        # Longer than clients keep idle connections (httpx 5 s, aiohttp 15 s): the client closes
        # first, never racing a request onto a connection the server is closing.
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    access_log.install()  # uvicorn.Config has just configured its loggers
    return Server(uv_config)


async def serve(config: ServerConfig, hard_exit: bool = False, starter=None, early=None) -> int:
    """Serves until SIGTERM/SIGINT (or until uvicorn stops), then drains and unloads; returns 0.

    `hard_exit` ends the process with os._exit after the drain, as neuron does: a thread still
    blocked in a download must not keep a stopped server alive. `starter` replaces the
    registry's model starter (see `multinode_starter`); `early`: the first startup model's
    engine, already spawned (see early_engine.py).
    """
    config.check_model_aliases()
    try:
        sock = bind_socket(config.host, config.port)
    except OSError as exc:
        raise ValueError(f"cannot listen on {config.host}:{config.port}: {exc.strerror}") from None
    config = config.with_overrides(port=sock.getsockname()[1])
    tracker = ActivationTracker(
        state="pre_warming" if config.default_models else "ready",
        pending=[spec.served_id for spec in config.default_models],
    )
    if early is not None:
        starter = early.starter()
    state = AppState(config=config, registry=ModelRegistry(config, starter), activation=tracker)
    server = _make_server(config, state)
    state.registry.start_idle_unloader()
    stop = asyncio.Event()
    _install_signal_handlers(stop)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    host = f"[{config.host}]" if ":" in config.host else config.host
    print(f"axon: listening on http://{host}:{config.port}", file=sys.stderr, flush=True)
    startup = asyncio.create_task(
        load_default_models(state.registry, config.default_models, tracker)
    )
    if early is not None:
        startup.add_done_callback(lambda _: early.discard())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    await _shutdown(state, server, serving, startup)
    stopping.cancel()
    sock.close()
    if hard_exit:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def _install_signal_handlers(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            print("axon: second signal, exiting now", file=sys.stderr, flush=True)
            os._exit(1)
        logger.info("%s received: draining", signal.Signals(signum).name)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)


async def _shutdown(state, server, serving: asyncio.Task, startup: asyncio.Task) -> None:
    """Stop admitting (503), drain and unload every model, then stop uvicorn."""
    grace = state.config.shutdown_grace_s
    state.shutting_down = True
    startup.cancel()  # the load it awaits is shielded; unload_all waits for it within the grace
    await state.registry.unload_all(grace)
    logger.info("all models unloaded")
    server.should_exit = True
    try:
        await asyncio.wait_for(serving, grace + 5.0)
    except (TimeoutError, asyncio.CancelledError):
        logger.warning("the HTTP server did not stop in time")
    except Exception:
        logger.exception("the HTTP server failed")
