"""`cluster serve MANIFEST` end to end, in its own process: it starts a Ray of its own,
deploys, prints the base URL, answers over HTTP, and on Ctrl-C shuts Serve and its Ray
down and exits 0. A second server on the same machine leaves the first one alone."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import urllib.error
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


class Server:
    """One `cluster serve` process and the lines it printed."""

    def __init__(
        self, target: str, env: dict[str, str] | None = None, flags: tuple[str, ...] = ()
    ) -> None:
        command = [sys.executable, "-m", "cluster.cli", "serve", target, *flags]
        self.proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env={**os.environ, "RAY_DEDUP_LOGS": "1", **(env or {})},
        )
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=_lines, args=(self.proc.stdout, self.lines), daemon=True).start()

    def wait_for(self, prefix: str, timeout_s: float) -> str:
        return _wait_for_line(self.lines, prefix, timeout_s, self.seen)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)  # Ctrl-C
        self.wait_for("shutting down", 30)
        try:  # Serve and Ray take a while to stop on a loaded 2-core machine
            assert self.proc.wait(timeout=150) == 0
        except subprocess.TimeoutExpired:
            raise AssertionError("no exit after Ctrl-C:\n" + "".join(self.seen[-40:])) from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)


def _completions(url: str, **fields) -> str:
    """The body of a greedy 4-token completion of "hi" (`fields` added to the request)."""
    body = {
        "model": "tiny",
        "prompt": "hi",
        "max_tokens": 4,
        "temperature": 0,  # two servers' unseeded samples need not agree
        "ignore_eos": True,
        **fields,
    }
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        return r.read().decode()


def _complete(url: str) -> int:
    return json.loads(_completions(url))["usage"]["completion_tokens"]


def _auto_tools_refused(url: str) -> bool:
    """A chat request with tools ("auto" by default) to a server without a tool-call
    parser: a 400 naming tool_choice, as vLLM without --enable-auto-tool-choice."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    try:
        urllib.request.urlopen(request, timeout=60)
    except urllib.error.HTTPError as e:
        return e.code == 400 and "tool_choice" in json.loads(e.read())["error"]["message"]
    return False


def _stream(url: str) -> str:
    """A streamed completion's text, from its server-sent events."""
    lines = _completions(url, stream=True).splitlines()
    events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])


def tiny_manifest(tmp_path, smollm2_path, name: str, **sections) -> str:
    """A manifest serving a tiny random model as "tiny" (its file's path)."""
    model = str(tmp_path / "m")
    make_tiny_chat_model(model, smollm2_path, num_hidden_layers=2)
    args = {
        "model": {"path": model, "id": "tiny", "device": "cpu", "dtype": "float32"},
        "placement": {"worker_cpus": 0.5, "threads_per_worker": 1},
        "cache": {"num_kv_blocks": 64},
        **sections,
    }
    args["model"]["max_model_len"] = 128
    app = {"name": name, "import_path": "cluster.serve:build_app", "args": args}
    manifest = tmp_path / f"{name}.yaml"
    manifest.write_text(yaml.safe_dump({"applications": [app]}))
    return str(manifest)


def test_two_cluster_serves_each_run_their_own_ray_and_stop_on_ctrl_c(tmp_path, smollm2_path):
    manifest = tiny_manifest(tmp_path, smollm2_path, "cli")
    # both on the default ingress, HAProxy: their HAProxys must not collide
    first = Server(manifest)
    second = None
    try:
        assert first.wait_for("HTTP ingress:", 180) == "haproxy"
        first_url = first.wait_for("base URL:", 30)
        with urllib.request.urlopen(f"{first_url}/health", timeout=30) as r:
            assert r.status == 200
        assert _complete(first_url) == 4
        assert _auto_tools_refused(first_url)
        # Only now the same manifest again (same application name), on the same machine:
        # joining the first one's Ray is what must not happen.
        second = Server(manifest)
        assert second.wait_for("HTTP ingress:", 180) == "haproxy"
        second_url = second.wait_for("base URL:", 30)
        assert second_url != first_url and _complete(second_url) == 4
        assert _stream(second_url) == _stream(first_url) != ""
        second.stop()
        assert _complete(first_url) == 4  # neither redeployed nor shut down by the second
        first.stop()
    finally:
        first.kill()
        if second is not None:
            second.kill()


def test_demo_prints_progress_answers_and_the_table_and_little_else(tmp_path, smollm2_path):
    """The main job's output, on a tiny model: its own lines, no Ray or Serve INFO logs,
    no actor output, no warnings at shutdown."""
    speculative = {"method": "ngram", "num_speculative_tokens": 3}
    manifest = tiny_manifest(tmp_path, smollm2_path, "demo", speculative=speculative)
    code = (
        "from cluster.demo import run_demo; "
        f"run_demo(max_new_tokens=4, prompts=['Hi'], manifest_path={manifest!r})"
    )
    env = {**os.environ, "CLUSTER_COMPILE": "off"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "| on (ngram) |" in done.stdout and "| off |" in done.stdout
    assert ">>> Hi" in done.stdout and "ready in" in done.stdout
    noise = [line for line in output.splitlines() if "INFO" in line or "(raylet)" in line]
    assert not noise and "Traceback" not in output, output[-3000:]
    assert len(output.splitlines()) < 30, output


def _hub_cache(tmp_path, smollm2_path, repo: str) -> str:
    """A Hugging Face cache holding `repo` at one commit (`main`), in the cache's layout."""
    cache = tmp_path / "hub"
    commit = "c" * 40
    folder = cache / f"models--{repo.replace('/', '--')}" / "snapshots" / commit
    make_tiny_chat_model(str(folder), smollm2_path, num_hidden_layers=2)
    (folder.parent.parent / "refs").mkdir()
    (folder.parent.parent / "refs" / "main").write_text(commit)
    return str(cache)


def test_cluster_serve_takes_a_hub_id_with_vllms_flags(tmp_path, smollm2_path):
    """`vllm serve ID -tp 2 --speculative-config ...` with `vllm` replaced by `cluster`:
    the model comes from a local Hub cache (offline) and is served under its id."""
    from cluster.parallel.spawn import free_port

    repo = "tiny-org/tiny-chat"
    env = {"HF_HUB_CACHE": _hub_cache(tmp_path, smollm2_path, repo), "HF_HUB_OFFLINE": "1"}
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    flags = ["--tensor-parallel-size", "2", "--speculative-config", spec, "--max-model-len", "128"]
    command = [sys.executable, "-m", "cluster.cli", "serve", repo, *flags]
    tools = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    printed = subprocess.run(
        [*command, *tools, "--print-manifest"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
    )
    app = yaml.safe_load(printed.stdout)["applications"][0]["args"]
    assert app["parallel"]["tensor_parallel_size"] == 2 and app["model"]["path"] == repo
    assert app["speculative"] == json.loads(spec)
    assert app["server"] == {"enable_auto_tool_choice": True, "tool_call_parser": "hermes"}
    manifest = tiny_manifest(tmp_path, smollm2_path, "plain")
    refused = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "serve", manifest, "-tp", "2"],
        capture_output=True,
        text=True,
    )
    assert refused.returncode != 0 and "--tensor-parallel-size" in refused.stderr

    server = Server(repo, env, (*flags, "--port", str(free_port()), "--dtype", "float32"))
    try:
        url = server.wait_for("base URL:", 240)
        body = json.loads(_completions(url, model=repo, max_tokens=24))
        assert body["model"] == repo and body["usage"]["completion_tokens"] == 24
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
            metrics = r.read().decode()
        assert "vllm:spec_decode_num_drafts_total" in metrics
        server.stop()
    finally:
        server.kill()


def test_enable_expert_parallel_sets_expert_parallel_size_to_the_tp_size():
    import argparse

    from cluster.serve.model_command import add_model_flags, manifest_config

    parser = argparse.ArgumentParser()
    add_model_flags(parser)
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    flags = parser.parse_args(["-tp", "4", "--enable-expert-parallel"])
    parallel = manifest_config("some/moe", flags)["applications"][0]["args"]["parallel"]
    assert parallel == {
        "tensor_parallel_size": 4,
        "pipeline_parallel_size": 1,
        "expert_parallel_size": 4,
    }
    plain = manifest_config("some/moe", parser.parse_args(["-tp", "4"]))
    assert "expert_parallel_size" not in plain["applications"][0]["args"]["parallel"]
