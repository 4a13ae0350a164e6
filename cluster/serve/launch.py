"""Deploying a manifest from Python or `cluster serve`: start Ray (or join the cluster the
user names), start Serve's HTTP proxy on the manifest's (or a free) port, run the
application, report its URL. What `cluster serve` did not start, it does not stop."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Any

import ray
from ray import serve

from cluster.parallel.spawn import free_port
from cluster.serve.builder import build_openai_app
from cluster.serve.manifest import Manifest, ManifestError


def connect_ray(address: str | None = None) -> bool:
    """A new local Ray of this process's own (`address` None or "local"), or the cluster at
    `address` ("auto": the one running on this machine). True when this process started
    Ray. Joining only when asked means a second server never redeploys the first one's
    application, or shuts down its Serve, by accident."""
    if ray.is_initialized():
        return False
    address = address or "local"
    ray.init(address=address)
    return address == "local"


def start_http(host: str = "127.0.0.1", port: int | None = None) -> tuple[str, int]:
    """Start Serve with its HTTP proxy on `port` (a free one when None)."""
    port = port or free_port(host if host != "0.0.0.0" else "127.0.0.1")
    serve.start(http_options={"host": host, "port": port})
    return host, port


def deploy(manifest: Manifest, host: str | None = None, port: int | None = None) -> tuple[Any, str]:
    """Deploy and wait until RUNNING; returns the LLMServer handle and the base URL
    (OpenAI clients use `<base URL>/v1`). A failed deploy removes the application."""
    try:  # a bad manifest fails here, before Serve or any actor starts
        app = build_openai_app(manifest.args, manifest.deployments)
    except ValueError as e:
        raise ManifestError(f"{manifest.path}: {e}") from None
    http = manifest.http_options
    host, port = start_http(host or http.get("host", "127.0.0.1"), port or http.get("port"))
    try:
        handle = serve.run(app, name=manifest.app_name, route_prefix=manifest.route_prefix)
    except BaseException:
        with contextlib.suppress(Exception):
            serve.delete(manifest.app_name)
        raise
    shown = "127.0.0.1" if host == "0.0.0.0" else host
    return handle, f"http://{shown}:{port}{manifest.route_prefix.rstrip('/')}"


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _stop_on_signals() -> None:
    """Ctrl-C and SIGTERM (what process managers send) both stop the server cleanly. SIGINT
    is set explicitly: a shell starting us in the background would leave it ignored."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)


def serve_forever(
    manifest: Manifest,
    address: str | None = None,
    host: str | None = None,
    port: int | None = None,
) -> None:
    """`cluster serve`: deploy, print the URL, serve until Ctrl-C or SIGTERM, then shut
    down cleanly: Serve and Ray when this process started Ray, otherwise only the
    application it deployed (the cluster and its other applications stay as they were)."""
    manifest.check_model()  # a bad manifest fails here, before Ray or any actor starts
    _stop_on_signals()
    started = connect_ray(address)
    try:
        _, url = deploy(manifest, host, port)
        print(f"serving {manifest.args.served_model_name!r} at {url}/v1 (Ctrl-C to stop)")
        print(f"base URL: {url}", flush=True)
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        print("shutting down", flush=True)
    finally:
        with contextlib.suppress(Exception):
            if started:
                serve.shutdown()
            else:
                serve.delete(manifest.app_name)
        if started:
            ray.shutdown()
