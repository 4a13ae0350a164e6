"""`cluster serve MANIFEST` end to end, in its own process: it starts Ray, deploys, prints
the base URL, answers over HTTP, and on Ctrl-C shuts Serve and Ray down and exits 0."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import urllib.request

import yaml
from tiny_models import make_tiny_chat_model


def _lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)
    out.put(None)


def _wait_for_line(lines: queue.Queue, prefix: str, timeout_s: float, seen: list[str]) -> str:
    while True:
        try:
            line = lines.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(
                f"no {prefix!r} line in {timeout_s} s; the server said:\n" + "".join(seen[-40:])
            ) from None
        if line is None:
            raise AssertionError("the server exited:\n" + "".join(seen[-40:]))
        seen.append(line)
        if line.startswith(prefix):
            return line[len(prefix) :].strip()


def test_cluster_serve_deploys_answers_and_stops_on_ctrl_c(tmp_path, smollm2_path):
    model = str(tmp_path / "m")
    make_tiny_chat_model(model, smollm2_path, num_hidden_layers=2)
    args = {
        "model": {"path": model, "id": "tiny", "device": "cpu", "dtype": "float32"},
        "placement": {"worker_cpus": 0.5, "threads_per_worker": 1},
        "cache": {"num_kv_blocks": 64},
    }
    args["model"]["max_model_len"] = 128
    app = {"name": "cli", "import_path": "cluster.serve:build_app", "args": args}
    manifest = tmp_path / "tiny.yaml"
    manifest.write_text(yaml.safe_dump({"applications": [app]}))
    command = [sys.executable, "-m", "cluster.cli", "serve", str(manifest), "--address", "local"]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "RAY_DEDUP_LOGS": "1"},
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
    seen: list[str] = []
    try:
        url = _wait_for_line(lines, "base URL:", 180, seen)
        with urllib.request.urlopen(f"{url}/health", timeout=30) as r:
            assert r.status == 200
        body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 4, "ignore_eos": True})
        request = urllib.request.Request(
            f"{url}/v1/completions", body.encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        _wait_for_line(lines, "shutting down", 30, seen)
        try:  # Serve and Ray take a while to stop on a loaded 2-core machine
            assert proc.wait(timeout=150) == 0
        except subprocess.TimeoutExpired:
            raise AssertionError("no exit after Ctrl-C:\n" + "".join(seen[-40:])) from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
