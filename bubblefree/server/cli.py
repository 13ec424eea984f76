"""``bubblefree serve``: load a model, serve it over HTTP until interrupted."""

from __future__ import annotations

import argparse
import sys

from bubblefree.server.settings import ServerSettings


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="bubblefree")
    commands = top.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model over HTTP (Moondream's and OpenAI's APIs)")
    defaults = ServerSettings()
    serve.add_argument("model", nargs="?", default=None,
                       help="a model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    serve.add_argument("--host", default=defaults.host,
                       help="address to listen on (default: loopback only)")
    serve.add_argument("--port", type=int, default=defaults.port)
    serve.add_argument("--api-key", default=None, help="require Authorization: Bearer <key>")
    serve.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes)
    serve.add_argument("--max-image-pixels", type=int, default=defaults.max_image_pixels,
                       help="larger images are refused (422) before they are decoded")
    serve.add_argument("--max-live", type=int, default=defaults.max_live,
                       help="requests live at once; more are answered 429")
    serve.add_argument("--timeout", type=float, default=defaults.request_timeout_s,
                       help="seconds a request may run before it is cancelled (504)")
    serve.add_argument("--device", default=None, help="cuda or cpu (default: cuda where there is one)")
    serve.add_argument("--location-tokens", action="store_true",
                       help="add the spatial skills' location tokens to a text model")
    serve.add_argument("--replicas", type=int, default=0,
                       help="run N engine replicas on Ray Serve (pip install bubblefree[ray]); "
                            "one GPU each where there are GPUs (default: one engine, no Ray)")
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    import uvicorn  # imported here: `--help` works without the server extra

    from bubblefree.engine import Engine
    from bubblefree.server.app import create_app

    settings = ServerSettings(host=args.host, port=args.port, api_key=args.api_key,
                              max_body_bytes=args.max_body_bytes, max_image_pixels=args.max_image_pixels,
                              max_live=args.max_live,
                              request_timeout_s=args.timeout, model_name=args.model or "smollm2-135m-instruct")
    options = {"location_tokens": True} if args.location_tokens else {}
    if args.replicas > 0:
        return serve_replicas(args, settings, options)
    with Engine.from_pretrained(args.model, device=args.device, **options) as engine:
        uvicorn.run(create_app(engine, settings), host=settings.host, port=settings.port,
                    log_level="info", timeout_graceful_shutdown=5)
    return 0


def serve_replicas(args: argparse.Namespace, settings: ServerSettings, options: dict) -> int:
    """Start Ray here (or join the cluster RAY_ADDRESS names), serve until interrupted."""
    import functools
    import threading

    import ray
    from ray import serve

    from bubblefree.engine import Engine
    from bubblefree.server.replicas import application

    ray.init(include_dashboard=False)
    gpus = ray.cluster_resources().get("GPU", 0) > 0 and args.device != "cpu"
    make = functools.partial(Engine.from_pretrained, args.model, device=args.device, **options)
    serve.start(http_options={"host": settings.host, "port": settings.port})
    serve.run(application(make, settings, args.replicas, gpus=gpus), name="bubblefree", route_prefix="/")
    print(f"{args.replicas} replicas on http://{settings.host}:{settings.port}", flush=True)
    try:
        threading.Event().wait()  # until interrupted
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
