"""The route server: where HAProxy asks which `LLMServer` replica takes an HTTP request.

Behind Serve's HAProxy ingress, a request goes straight to a replica's own HTTP server,
so Serve's request router never sees it. With an ingress request router attached to the
application, HAProxy first posts the request's body to `/internal/route` on it and
forwards the request to the replica it names. This deployment is that router: it turns
the body into the prompt's token ids exactly as a replica would (the chat template, the
tokenizer: `server.request_prompt`) and asks the `LLMServer` deployment's request router
(`prefix_router.PrefixCacheRouter`) for a replica. A body it cannot read (not JSON, a
wrong field, a truncated body) still gets a replica, the least-loaded one; the replica
then answers the request, errors included.

HAProxy forwards the body only when Serve's processes run with
`RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1` (a Ray started by `cluster serve` does;
`ray start` needs it in its environment, next to `RAY_SERVE_ENABLE_HA_PROXY=1`).
"""

import json
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from ray import serve
from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from cluster.engine.frontend import FrontEnd, process_prompt
from cluster.serve.args import ClusterArgs
from cluster.serve.openai_protocol import ChatCompletionRequest, CompletionRequest
from cluster.serve.prefix_router import PROMPT_TOKEN_IDS
from cluster.serve.protocol import GenerateRequest
from cluster.serve.server import request_prompt

ROUTE_DEPLOYMENT = "PrefixRouter"


def make_route_server_class() -> type:
    """The deployment class, with its own FastAPI app (nothing at module level)."""
    app = FastAPI()

    @serve.ingress(app)
    class PrefixRouteServer:
        def __init__(self, server: DeploymentHandle, args: ClusterArgs | dict[str, Any]) -> None:
            from transformers import AutoTokenizer

            model = ClusterArgs.model_validate(args).engine_config().model
            self.frontend = FrontEnd(AutoTokenizer.from_pretrained(model.tokenizer_path), model)
            self.server = server

        @app.post("/internal/route")
        async def route(self, request: Request) -> dict[str, Any]:
            """HAProxy's question; {"host", "port", "replica_id"} of the chosen replica."""
            token_ids = self.prompt_token_ids(await request.body())
            hint = {PROMPT_TOKEN_IDS: token_ids} if token_ids else {}
            try:
                # `_reserve=False`: the request itself goes through HAProxy, not this handle
                async with self.server.choose_replica(_reserve=False, **hint) as selection:
                    replica = selection._replica  # as Ray Serve LLM's own router reads it
                    endpoint = replica.backend_http_endpoint
                    if endpoint is None:
                        raise RuntimeError(f"replica {selection.replica_id} has no HTTP port")
                    host, port = endpoint
                    replica_id = replica.replica_id.to_full_id_str()
            except (RuntimeError, DeploymentUnavailableError) as e:
                raise HTTPException(status_code=503, detail=str(e)) from None
            return {"host": host, "port": port, "replica_id": replica_id}

        @app.get("/health")
        async def health(self) -> dict[str, str]:
            return {"status": "ok"}

        def prompt_token_ids(self, body: bytes) -> list[int]:
            """The prompt's token ids as a replica would compute them; [] when the body is
            not a request this server can read (the replica will say what is wrong)."""
            try:
                data = json.loads(body)
                kind = ChatCompletionRequest if "messages" in data else CompletionRequest
                fields = kind.model_validate(data).prompts()[0]  # the first prompt of a batch
                fields.pop("echo", None)
                prompt = request_prompt(GenerateRequest(**fields), self.frontend)
                frontend = self.frontend
                _, ids = process_prompt(
                    prompt, frontend.tokenizer, frontend.max_model_len, frontend.vocab_size
                )
            except Exception:
                return []
            return ids

    return PrefixRouteServer
