"""Pipeline stages behind a real Serve deployment: PP=2 and PP=3 replicas (speculation
off, EAGLE, EAGLE-3 with its layers on three stages) give the one-stage engine's greedy
tokens, and a killed stage actor fails its requests fast and gets the replica replaced."""

import asyncio
import os
import time

import openai
import pytest
import ray
import yaml
from random_heads import write_all
from ray import serve
from ray_helpers import engine_actor_names, init_local_ray, wait_for
from tiny_models import make_tiny_chat_model

from cluster import LLM, SamplingParams
from cluster.serve import load_manifest
from cluster.serve.launch import deploy
from cluster.serve.protocol import GenerateRequest

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [[5, 6, 7], list(range(100, 127)), [9, 8, 9, 8, 9, 8, 9, 8, 9]]
APPS = {  # name -> (parallel section, draft method)
    "pp2": ({"pipeline_parallel_size": 2}, None),
    "pp2-eagle": ({"pipeline_parallel_size": 2}, "eagle"),
    "pp3-eagle3": ({"pipeline_parallel_size": 3, "pipeline_layer_partition": [3, 2, 3]}, "eagle3"),
}


def _manifest(folder, model, name, parallel, spec):
    args = {
        "model": {"path": model, "id": name, "device": "cpu", "dtype": "float32"},
        "parallel": parallel,
        "placement": {"worker_cpus": 0.1, "threads_per_worker": 1},
        "cache": {"num_kv_blocks": 128},
        "scheduler": {"max_num_seqs": 8},
        # no in-place engine restarts: the killed stage must get the replica replaced
        "server": {"max_engine_restarts": 0},
    }
    args["model"]["max_model_len"] = 512
    if spec is not None:
        args["speculative"] = {**spec, "num_speculative_tokens": 3}
    deployment = {"name": "LLMServer", "health_check_period_s": 1}
    deployment["graceful_shutdown_timeout_s"] = 1
    app = {"name": name, "route_prefix": f"/{name}", "import_path": "cluster.serve:build_app"}
    app.update(args=args, deployments=[deployment])
    path = os.path.join(folder, f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump({"applications": [app]}, f)
    return load_manifest(path)


@pytest.fixture(scope="module")
def apps(tmp_path_factory, smollm2_path):
    folder = str(tmp_path_factory.mktemp("serve_pp"))
    model = os.path.join(folder, "m")
    make_tiny_chat_model(model, smollm2_path, num_hidden_layers=8, seed=6)
    specs = write_all(os.path.join(folder, "drafts"), model)
    with LLM(model, dtype="float32", max_model_len=512, num_kv_blocks=128) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        reference = [o.outputs[0].token_ids for o in outs]
    init_local_ray(num_cpus=2)
    urls = {}
    for name, (parallel, method) in APPS.items():
        spec = None if method is None else specs[method]
        _, urls[name] = deploy(_manifest(folder, model, name, parallel, spec))
    yield urls, reference
    serve.shutdown()
    ray.shutdown()


async def _generate(handle, prompts):
    requests = [  # all in flight at once
        handle.generate.remote(GenerateRequest(prompt_token_ids=p, sampling_params=GREEDY))
        for p in prompts
    ]
    return [await r for r in requests]


@pytest.mark.parametrize("name", list(APPS))
def test_pipeline_replica_gives_one_stage_greedy_tokens(apps, name):
    _, reference = apps
    outs = asyncio.run(_generate(serve.get_deployment_handle("LLMServer", name), PROMPTS))
    assert [o.token_ids for o in outs] == reference
    if APPS[name][1] is not None:
        assert sum(o.num_draft_tokens for o in outs) > 0


async def _engine_id(handle):
    return (await handle.stats.remote())["engine_id"]


def test_killed_stage_fails_its_requests_fast_and_the_replica_is_replaced(apps):
    urls, reference = apps
    handle = serve.get_deployment_handle("LLMServer", "pp2")
    engine = asyncio.run(_engine_id(handle))
    client = openai.OpenAI(base_url=f"{urls['pp2']}/v1", api_key="unused", max_retries=0)
    long = dict(model="pp2", prompt="go on", max_tokens=480, extra_body={"ignore_eos": True})
    stream = client.completions.create(**long, stream=True)
    next(iter(stream))
    victim = f"cluster-{engine}-worker-0"  # stage 0; the scheduler waits on stage 1
    ray.kill(ray.get_actor(victim, namespace="cluster"))
    killed_at = time.monotonic()
    with pytest.raises(openai.APIError, match="dead"):
        for _ in stream:
            pass
    assert time.monotonic() - killed_at < 10

    def replaced():
        state = serve.status().applications["pp2"].deployments["LLMServer"]
        return state.status == "HEALTHY" and not engine_actor_names(f"cluster-{engine}")

    wait_for(replaced, 90, "Serve to replace the replica with the dead stage")
    assert asyncio.run(_engine_id(handle)) != engine
    assert [o.token_ids for o in asyncio.run(_generate(handle, PROMPTS))] == reference


def test_smollm2_pipeline_replica_with_eagle3_on_three_stages(apps, smollm2_path, tmp_path):
    """SmolLM2 (30 layers) at PP=3: EAGLE-3 reads layers 2, 15 and 27, one per stage."""
    with LLM(smollm2_path, dtype="float32", max_model_len=512, num_kv_blocks=128) as llm:
        tokenizer = llm.get_tokenizer()
        prompts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
            for q in ("What is the capital of France?", "Write a haiku about rain.")
        ]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        reference = [o.outputs[0].token_ids for o in outs]
    spec = {"method": "eagle3", "model": "builtin:smollm2-eagle3"}
    deploy(_manifest(str(tmp_path), smollm2_path, "smol-pp3", {"pipeline_parallel_size": 3}, spec))
    try:
        outs = asyncio.run(_generate(serve.get_deployment_handle("LLMServer", "smol-pp3"), prompts))
        assert [o.token_ids for o in outs] == reference
        assert sum(o.num_accepted_tokens for o in outs) > 0  # the trained head is right at times
    finally:
        serve.delete("smol-pp3")
