"""``bubblefree serve``: load a model, serve it over HTTP until interrupted."""

from __future__ import annotations

import argparse
import errno
import functools
import os
import signal
import socket
import sys
import threading
from typing import Any, Callable

from bubblefree.images import pillow_max_pixels
from bubblefree.server.settings import ServerSettings

# --random: the shapes Engine.moondream_random builds, and the name the server gives each.
RANDOM = {"moondream-tiny": "moondream2-random-tiny", "moondream-full": "moondream2-random-full"}
# How long ``serve`` waits for the decode thread once it has stopped serving.
# The loop's own default (60 s, then 10 s more at exit) suits a library
# caller; a server whose decode thread hangs in a device call then took
# 71 s to exit on SIGTERM, past an orchestrator's usual 30 s grace before
# SIGKILL. A healthy thread ends in a few steps' time.
SERVE_CLOSE_WAIT_S = 10.0


def _bounded(kind: type, low: float, high: float | None = None, above: bool = False) -> Callable[[str], Any]:
    """An argparse ``type``: ``kind`` within bounds, so a bad value is a
    usage error naming its flag (exit 2) before any model loads."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        ok = (value > low if above else value >= low) and (high is None or value <= high)
        if not ok:  # NaN fails every comparison
            bound = f"> {_num(low)}" if above else f">= {_num(low)}"
            span = bound if high is None else f"in [{_num(low)}, {_num(high)}]"
            raise argparse.ArgumentTypeError(f"must be {span}, got {text}")
        return value
    return parse


def _num(bound: float) -> str:
    """A bound as a flag's error shows it: an integer whole (178956970,
    not 1.78957e+08), another number short."""
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="bubblefree")
    commands = top.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model over HTTP (Moondream's and OpenAI's APIs)")
    defaults = ServerSettings()
    serve.add_argument("model", nargs="?", default=None,
                       help="a model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    serve.add_argument("--random", choices=sorted(RANDOM), default=None,
                       help="for benchmarks and tests: moondream2 with random weights, built in memory "
                            "(full: moondream2's shapes; tiny: small widths, runs on a CPU); its answers "
                            "are noise, its shapes and timings moondream2's")
    serve.add_argument("--host", default=defaults.host,
                       help="address to listen on (default: loopback only)")
    serve.add_argument("--port", type=_bounded(int, 0, 65535), default=defaults.port,
                       help="0: any free port")
    serve.add_argument("--api-key", default=None, help="require Authorization: Bearer <key>")
    serve.add_argument("--max-body-bytes", type=_bounded(int, 1), default=defaults.max_body_bytes)
    serve.add_argument("--max-json-values", type=_bounded(int, 1), default=defaults.max_json_values,
                       help="values a JSON body may hold (413 past it; it is parsed on the event loop, "
                            f"so this bounds how long one body holds up the others; default "
                            f"{defaults.max_json_values})")
    serve.add_argument("--max-image-pixels", type=_bounded(int, 1, pillow_max_pixels()),
                       default=defaults.max_image_pixels,
                       help="larger images are refused (422) before they are decoded")
    serve.add_argument("--max-live", type=_bounded(int, 1), default=defaults.max_live,
                       help="requests live at once; more are answered 429")
    serve.add_argument("--timeout", type=_bounded(float, 0, above=True), default=defaults.request_timeout_s,
                       help="seconds a request may run before it is cancelled (504)")
    serve.add_argument("--body-timeout", type=_bounded(float, 0, above=True), default=defaults.body_timeout_s,
                       help="seconds a request's whole body may take to arrive (408 past it)")
    serve.add_argument("--stall-timeout", type=_bounded(float, 0, above=True), default=defaults.stall_s,
                       help="seconds the decode thread may hold requests without a step ending before "
                            f"/health answers 503 (a hung kernel or listener; default {defaults.stall_s:g})")
    serve.add_argument("--max-header-bytes", type=_bounded(int, 1), default=defaults.max_header_bytes,
                       help="bytes a request's line and headers may take together (431 past it, and the "
                            f"connection closed; default {defaults.max_header_bytes})")
    # None, not the default: --replicas refuses it given (Ray Serve's proxy has no such bound).
    serve.add_argument("--header-timeout", type=_bounded(float, 0, above=True), default=None,
                       help="seconds a request's line and headers may take to arrive, from the connection's "
                            "opening or the previous answer's end, however fast its bytes come (408 past "
                            f"it, and the connection closed; default {defaults.header_timeout_s:g}; "
                            "not with --replicas)")
    serve.add_argument("--device", default=None,
                       help="cuda, cuda:N or cpu (default: cuda where there is one; CUDA_VISIBLE_DEVICES "
                            "chooses which GPUs cuda sees)")
    serve.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                       help="uvicorn's; info logs every request (a cost under heavy load)")
    serve.add_argument("--location-tokens", action="store_true",
                       help="add the spatial skills' location tokens to a text model")
    serve.add_argument("--replicas", type=_bounded(int, 0), default=0,
                       help="run N engine replicas on Ray Serve (pip install bubblefree[ray]); "
                            "one GPU each where there are GPUs (default: one engine, no Ray)")
    return top


def main(argv: list[str] | None = None) -> int:
    top = parser()
    args = top.parse_args(argv)
    if args.random and (args.model or args.location_tokens):
        top.error("--random builds its own model: give no MODEL and no --location-tokens")
    refused = startup_refusal(args)
    if refused is not None:  # before a model load of minutes, not after it
        print(f"bubblefree serve: error: {refused}", file=sys.stderr)
        return 2
    import uvicorn  # imported here: `--help` works without the server extra

    from bubblefree.core import InvalidRequest
    from bubblefree.cuda_backend.errors import ModelLoadError, UnsupportedModel
    from bubblefree.server.app import create_app
    from bubblefree.server.protocol import http_protocol

    settings = settings_of(args)
    make = engine_maker(args)
    if args.replicas > 0:
        return serve_replicas(args, settings, make)
    try:
        engine = make()
    except KeyboardInterrupt:
        print("bubblefree serve: interrupted while loading the model", file=sys.stderr)
        return 130
    except (InvalidRequest, ModelLoadError, UnsupportedModel) as err:
        # A bad path, checkpoint or option: the message says which; a traceback would not add to it.
        print(f"bubblefree serve: error: {err}", file=sys.stderr)
        return 2
    engine.loop.close_wait = min(engine.loop.close_wait, SERVE_CLOSE_WAIT_S)
    # uvicorn shuts down gracefully on SIGINT and SIGTERM, restores the
    # handlers it found, then raises the signal again: SIGTERM's default
    # would end the process there, before the engine closed.
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        with engine:
            # lifespan off: the app has no startup or shutdown handlers, and with
            # uvicorn's lifespan task running a second Ctrl-C cancelled it mid-wait,
            # logging its CancelledError traceback over a clean shutdown.
            uvicorn.run(create_app(engine, settings), host=settings.host, port=settings.port,
                        http=http_protocol(settings), log_level=args.log_level, timeout_graceful_shutdown=5,
                        lifespan="off")
    except (KeyboardInterrupt, Terminated):
        pass  # the server stopped on the signal; the engine closed on the way out
    finally:
        signal.signal(signal.SIGTERM, previous)
    print("bubblefree serve: stopped", file=sys.stderr, flush=True)
    return 0


class Terminated(BaseException):
    """SIGTERM, once uvicorn has shut down: leaves ``with engine`` like Ctrl-C."""


def settings_of(args: argparse.Namespace) -> ServerSettings:
    """The server's settings from ``serve``'s parsed options."""
    header_timeout = ServerSettings().header_timeout_s if args.header_timeout is None else args.header_timeout
    return ServerSettings(host=args.host, port=args.port, api_key=args.api_key,
                          max_body_bytes=args.max_body_bytes, max_json_values=args.max_json_values,
                          max_image_pixels=args.max_image_pixels, max_live=args.max_live,
                          request_timeout_s=args.timeout, body_timeout_s=args.body_timeout,
                          max_header_bytes=args.max_header_bytes, header_timeout_s=header_timeout,
                          stall_s=args.stall_timeout,
                          model_name=RANDOM.get(args.random) or args.model or "smollm2-135m-instruct")


def _terminated(*_: Any) -> None:
    raise Terminated


def startup_refusal(args: argparse.Namespace) -> str | None:
    """Why ``serve`` must not start with these arguments (an empty model
    path, an API key no client could send, an option ``--replicas``
    cannot honour, an address it cannot listen on), or None."""
    from bubblefree.server.guard import api_key_refusal

    if args.model == "":  # an unset variable, say; Path("") would be the working directory
        return "model path: empty (give a model directory or .gguf file, or none for the embedded model)"
    if args.api_key is not None:
        refused = api_key_refusal(args.api_key)
        if refused is not None:
            return f"--api-key: {refused}"
    if args.replicas > 0:
        if args.header_timeout is not None:
            return ("--header-timeout: not available with --replicas (Ray Serve's proxy reads headers "
                    "without a time bound; put a reverse proxy that bounds it in front)")
        refused = ray_address_refused(os.environ.get("RAY_ADDRESS", ""))
        if refused is not None:
            return refused
    return address_refused(args.host, args.port)


def ray_address_refused(address: str, timeout_s: float = 5.0) -> str | None:
    """Why ``--replicas`` cannot join the cluster ``address`` (RAY_ADDRESS)
    names: nothing answers on its host and port within ``timeout_s``. Ray
    itself retries such an address for minutes, its log repeating, before
    it gives up. None where there is nothing to probe: no address (Ray
    starts here), ``auto`` or ``local`` (Ray's own lookups), or no port."""
    address = address.strip()
    target = address.removeprefix("ray://")
    if target in ("", "auto", "local"):
        return None
    host, sep, port = target.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()):  # "\u00b2".isdigit(), but int() refuses it
        return None
    host = host.strip("[]")  # an IPv6 address is written [::1]:6379
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return None
    # OverflowError: a port past 65535; UnicodeError: a name the IDNA codec
    # refuses (a label empty or over 63 characters), before any lookup.
    except (OSError, OverflowError, UnicodeError) as err:
        why = getattr(err, "strerror", None) or str(err) or type(err).__name__
        return f"RAY_ADDRESS {address!r}: nothing answers at {host}:{port} ({why})"


def address_refused(host: str, port: int) -> str | None:
    """Why the server could not listen on ``host:port`` (the port taken, the
    host not an address of this machine), or None. Checked by binding a
    probe socket as uvicorn and Ray's proxy bind theirs (SO_REUSEADDR), and
    closing it at once; port 0 (any free port) binds wherever the host is
    one of this machine's, so the host is checked whatever the port."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as err:  # UnicodeError: a name the IDNA codec refuses
        return f"--host {host!r}: {getattr(err, 'strerror', None) or err}"
    family, _, _, _, address = infos[0]
    try:
        with socket.create_server(address, family=family):
            return None
    except OSError as err:
        return _bind_refusal(host, port, err)


def _bind_refusal(host: str, port: int, err: OSError) -> str:
    """A failed bind, naming the flag to change: an address this machine
    does not have is the host's fault whatever the port (the port was
    named, and a user changed the wrong flag); a port taken or not allowed
    is the port's."""
    if err.errno == errno.EADDRNOTAVAIL:
        # The bare reason: create_server's own names the port it tried, here beside the point.
        return f"--host {host!r}: {os.strerror(err.errno)} (not an address of this machine)"
    return f"--port {port} on {host}: {err.strerror or err}"


def engine_maker(args: argparse.Namespace) -> Callable[[], Any]:
    """What builds the engine (here, or on each replica): a picklable call."""
    from bubblefree.engine import Engine

    # The engine checks images too: it gets the server's limit, not its own default.
    limit = {"max_image_pixels": args.max_image_pixels}
    if args.random:
        return functools.partial(Engine.moondream_random, args.random.removeprefix("moondream-"),
                                 device=args.device, **limit)
    options = {"location_tokens": True} if args.location_tokens else {}
    return functools.partial(Engine.from_pretrained, args.model, device=args.device, **limit, **options)


def serve_replicas(args: argparse.Namespace, settings: ServerSettings, make: Callable[[], Any]) -> int:
    """Start Ray here (or join the cluster RAY_ADDRESS names), serve until
    SIGINT or SIGTERM."""

    import ray
    from ray import serve

    from bubblefree.server.replicas import APP, application, deploy_failure
    from bubblefree.server.replicas import stop as stop_application

    try:  # before the handlers below: Ctrl-C here is Python's KeyboardInterrupt
        ray.init(include_dashboard=False)
        gpus = ray.cluster_resources().get("GPU", 0) > 0 and args.device != "cpu"
        # Ray's proxy logs every request and disconnect at info, as uvicorn does.
        serve.start(http_options={"host": settings.host, "port": settings.port},
                    logging_config={"log_level": args.log_level.upper(),
                                    "enable_access_log": args.log_level in ("debug", "info")})
    except KeyboardInterrupt:
        print("bubblefree serve: interrupted while starting Ray", file=sys.stderr)
        ray.shutdown()
        return 130
    stop = StopSignals()
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            serve.run(application(make, settings, args.replicas, gpus=gpus, log_level=args.log_level),
                      name=APP, route_prefix="/")
        except RuntimeError:
            failure = deploy_failure()
            if failure is None:
                raise
            # A replica could not build its engine: said as one line, as without
            # replicas (Ray's log above holds the replica's traceback).
            kind, message = failure
            known = kind in ("InvalidRequest", "ModelLoadError", "UnsupportedModel")
            print(f"bubblefree serve: error: {message if known else f'{kind}: {message}'}", file=sys.stderr)
            return 2 if known else 1
        stop.started()
        print(f"{args.replicas} replicas on http://{settings.host}:{settings.port}", flush=True)
        while not stop.flag.wait(0.5):
            pass
    except KeyboardInterrupt:  # the first signal, during the start
        pass
    finally:
        stop.started()  # from here a signal only sets the flag
        stop_application()
        ray.shutdown()
        for sig, handler in previous.items():  # only now: a signal mid-shutdown must not cut it short
            signal.signal(sig, handler)
    return 0


class StopSignals:
    """The SIGINT and SIGTERM handler of ``serve --replicas``. The first
    signal during the start interrupts it (a start that never ends can
    still be stopped); every other one only sets ``flag``. A
    KeyboardInterrupt raised again by a second signal while the first
    unwound (the start, or a lock's wait) broke the shutdown; the replicas
    answer before ``serve.run`` returns, so a client may signal twice
    before it has."""

    def __init__(self) -> None:
        self.flag = threading.Event()
        self.starting = True

    def __call__(self, *_: Any) -> None:
        self.flag.set()
        if self.starting:
            self.starting = False
            raise KeyboardInterrupt

    def started(self) -> None:
        self.starting = False


if __name__ == "__main__":
    sys.exit(main())
