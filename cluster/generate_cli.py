"""`cluster generate` and `cluster chat`: text from a manifest's engine in this process
(`LLM.from_manifest`), or from a running server's OpenAI routes (`--url`).

The HTTP side uses only the standard library: it streams server-sent events and prints
the text as it arrives.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Iterator
from typing import Any, TextIO

from cluster.sampling_params import SamplingParams


class RemoteModel:
    """The OpenAI routes of a server started with `cluster serve`."""

    def __init__(self, url: str, api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        if not self.url.endswith("/v1"):
            self.url += "/v1"
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        with urllib.request.urlopen(self._request("/models"), timeout=60) as r:
            self.model = json.loads(r.read())["data"][0]["id"]

    def _request(self, path: str, body: dict[str, Any] | None = None) -> urllib.request.Request:
        data = None if body is None else json.dumps(body).encode()
        return urllib.request.Request(self.url + path, data, self.headers)

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The stream's JSON events; an error event raises RuntimeError."""
        body = {**body, "model": self.model, "stream": True}
        with urllib.request.urlopen(self._request(path, body), timeout=600) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    raise RuntimeError(event["error"]["message"])
                yield event


def _sampling(args: Any) -> dict[str, Any]:
    return {"max_tokens": args.max_tokens, "temperature": args.temperature}


def run_generate(args: Any, out: TextIO | None = None) -> None:
    """Print each prompt followed by its completion."""
    out = out or sys.stdout
    if args.url:
        remote = RemoteModel(args.url, args.api_key)
        for prompt in args.prompts:
            out.write(prompt)
            body = {"prompt": prompt, **_sampling(args)}
            for event in remote.stream("/completions", body):
                out.write(event["choices"][0]["text"] if event["choices"] else "")
                out.flush()
            out.write("\n")
        return
    with _offline(args) as llm:
        params = SamplingParams(**_sampling(args))
        for output in llm.generate(args.prompts, params, use_tqdm=False):
            out.write(f"{output.prompt}{output.outputs[0].text}\n")


def run_chat(args: Any, stdin: TextIO | None = None, out: TextIO | None = None) -> None:
    """A conversation: one user turn per input line, until end of input or /exit."""
    stdin, out = stdin or sys.stdin, out or sys.stdout
    remote = RemoteModel(args.url, args.api_key) if args.url else None
    llm = None if remote else _offline(args)
    history: list[dict[str, str]] = []
    try:
        for line in stdin:
            text = line.strip()
            if text == "/exit":
                break
            if not text:
                continue
            history.append({"role": "user", "content": text})
            if remote is not None:
                pieces = []
                body = {"messages": history, **_sampling(args)}
                for event in remote.stream("/chat/completions", body):
                    piece = event["choices"][0]["delta"].get("content") or ""
                    pieces.append(piece)
                    out.write(piece)
                    out.flush()
                answer = "".join(pieces)
            else:
                params = SamplingParams(**_sampling(args))
                answer = llm.chat(history, params, use_tqdm=False)[0].outputs[0].text
                out.write(answer)
            out.write("\n")
            history.append({"role": "assistant", "content": answer})
    finally:
        if llm is not None:
            llm.shutdown()


def _offline(args: Any) -> Any:
    from cluster.llm import LLM

    return LLM.from_manifest(args.manifest) if args.manifest else LLM()
