"""Manifests and the serving front end without a Ray cluster: what a manifest means, what
it refuses (before any actor could start), the dry run, `LLM.from_manifest`, placement
and rank order, and the mapping of OpenAI requests onto `SamplingParams`."""

import copy
import json
import os

import pytest
import yaml
from pydantic import ValidationError

from cluster import LLM, SamplingParams
from cluster.actors import PlacementConfig, WorkerSlot, rank_order
from cluster.actors.placement import rendezvous_host
from cluster.cli import main
from cluster.serve import GenerateRequest, ManifestError, validate_manifest
from cluster.serve.manifest import (
    deployment_plan,
    load_manifest,
    parse_manifest,
    read_manifest_args,
)
from cluster.serve.openai_protocol import ChatCompletionRequest, CompletionRequest

MANIFESTS = os.path.join(os.path.dirname(__file__), "..", "cluster", "manifests")
DEFAULT = os.path.join(MANIFESTS, "default.yaml")
GPU_EXAMPLES = {"llama3-8b-eagle3-tp2.yaml": 2, "llama3-70b-tp8-multinode.yaml": 8}


def default_config():
    with open(DEFAULT) as f:
        return yaml.safe_load(f)


def test_default_manifest_is_the_embedded_default_with_its_eagle3_head(smollm2_path):
    manifest, model_checked = validate_manifest(DEFAULT)
    assert model_checked
    args = manifest.args
    assert args.model.path is None and args.model_path() == smollm2_path
    assert args.served_model_name == "SmolLM2-135M-Instruct"
    assert args.parallel.tensor_parallel_size == 1 and args.model.device == "cpu"
    engine_args = args.engine_args()
    assert engine_args["speculative_config"] == {
        "method": "eagle3",
        "model": "builtin:smollm2-eagle3",
        "num_speculative_tokens": 3,
        "adaptive": True,
        "hybrid_lookup_min": 2,
        "min_draft_confidence": 0.3,
    }
    spec = args.engine_config().speculative
    assert spec.resolved_method == "eagle3" and os.path.isfile(
        os.path.join(spec.model, "model.safetensors")
    )
    assert engine_args["model"] == smollm2_path and engine_args["max_num_seqs"] == 32
    plan = deployment_plan(manifest)
    assert plan["llm_server"]["placement_group_bundles"] == [{"CPU": 1.1}]  # replica merged
    assert plan["llm_server"]["num_replicas"] == 1


@pytest.mark.parametrize("name", sorted(GPU_EXAMPLES))
def test_gpu_examples_validate_where_their_models_are_absent(name):
    manifest, model_checked = validate_manifest(os.path.join(MANIFESTS, name))
    assert not model_checked  # no /models here: the schema is checked, the model is not
    tp = GPU_EXAMPLES[name]
    bundles = deployment_plan(manifest)["llm_server"]["placement_group_bundles"]
    assert len(bundles) == tp and all(b["GPU"] == 1 for b in bundles)
    assert bundles[0]["CPU"] == bundles[1]["CPU"] + manifest.args.placement.replica_cpus
    with pytest.raises(ManifestError, match="is not a folder"):  # deploying it here fails early
        manifest.check_model()


def _edit(config, path, value):
    node = config
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return config


APP = ("applications", 0)
BAD = {
    "tp_not_dividing_heads": (
        (*APP, "args", "parallel", "tensor_parallel_size"),
        2,
        "must divide the model's num_attention_heads=9",
    ),
    "missing_model": ((*APP, "args", "model", "path"), "/nowhere/model", "is not a folder"),
    "k_is_zero": (
        (*APP, "args", "speculative", "num_speculative_tokens"),
        0,
        "num_speculative_tokens must be an integer >= 1",
    ),
    "unknown_section": ((*APP, "args", "tensor_parallel"), 2, "Extra inputs are not permitted"),
    "unknown_speculative_key": (
        (*APP, "args", "speculative", "num_spec_tokens"),
        3,
        r"speculative: unknown keys \['num_spec_tokens'\]",
    ),
    "unknown_field": ((*APP, "args", "model", "pth"), "x", "Extra inputs are not permitted"),
    "pipeline_deeper_than_model": (
        (*APP, "args", "parallel", "pipeline_parallel_size"),
        31,
        "pipeline_parallel_size=31 exceeds the model's num_hidden_layers=30",
    ),
    "bad_layer_partition": (
        (*APP, "args", "parallel", "pipeline_layer_partition"),
        [10, 10],
        r"pipeline_layer_partition=\[10, 10\] has 2 entries; pipeline_parallel_size=1",
    ),
    "kv_too_small": ((*APP, "args", "cache", "num_kv_blocks"), 4, "fewer tokens than one sequence"),
    "unknown_deployment_key": ((*APP, "deployments", 0, "replicas"), 2, "unknown keys"),
    "engine_owned_option": (
        (*APP, "deployments", 0, "ray_actor_options"),
        {"num_cpus": 4},
        "derived from args.parallel",
    ),
    "unknown_deployment": ((*APP, "deployments", 0, "name"), "Router", "unknown deployment"),
    "former_ingress": ((*APP, "deployments", 0, "name"), "OpenAIIngress", "serve the OpenAI"),
    "not_our_builder": ((*APP, "import_path"), "other.module:app", "exactly one application"),
    "bad_serve_option": ((*APP, "deployments", 0, "num_replicas"), -3, "not a valid Serve"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_manifests_are_refused_before_anything_starts(case, smollm2_path):
    path, value, message = BAD[case]
    config = _edit(copy.deepcopy(default_config()), path, value)
    with pytest.raises(ManifestError, match=message):
        parse_manifest(config, "m.yaml").check_model()


def test_dry_run_prints_the_plan_and_bad_files_exit_with_the_reason(capsys, tmp_path):
    main(["serve", "--dry-run", os.path.join(MANIFESTS, "llama3-8b-eagle3-tp2.yaml")])
    plan = json.loads(capsys.readouterr().out)
    assert plan["speculative"]["method"] == "eagle3" and plan["tensor_parallel_size"] == 2
    assert plan["llm_server"]["placement_group_strategy"] == "STRICT_PACK"
    assert plan["llm_server"]["autoscaling_config"]["max_replicas"] == 4
    # a replica being replaced drains its streams for up to 10 minutes (Serve's 20 s
    # default cut answers mid-stream on a redeploy), unless the manifest says otherwise
    assert plan["llm_server"]["graceful_shutdown_timeout_s"] == 600
    config = default_config()
    config["applications"][0]["deployments"] = [
        {"name": "LLMServer", "graceful_shutdown_timeout_s": 30}
    ]
    short = tmp_path / "short.yaml"
    short.write_text(yaml.safe_dump(config))
    main(["serve", "--dry-run", str(short)])
    assert json.loads(capsys.readouterr().out)["llm_server"]["graceful_shutdown_timeout_s"] == 30
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_edit(default_config(), (*APP, "args", "seeds"), 1)))
    with pytest.raises(SystemExit, match="invalid args"):
        main(["serve", "--dry-run", str(bad)])


def test_from_manifest_with_overrides_and_generate_cli_agree(capsys, smollm2_path):
    params = SamplingParams(temperature=0, max_tokens=6)
    with LLM.from_manifest(DEFAULT, speculative_config=None, max_model_len=256) as llm:
        assert llm.config.speculative is None  # the override turned speculation off
        assert llm.config.model.max_model_len == 256
        assert llm.config.scheduler.max_num_seqs == 32  # the rest comes from the file
        text = llm.generate("Hello, my name is", params, use_tqdm=False)[0].outputs[0].text
    # The CLI runs the manifest as written (n-gram speculation on): greedy text is the same.
    main(["generate", "--manifest", DEFAULT, "--max-tokens", "6", "Hello, my name is"])
    assert capsys.readouterr().out == f"Hello, my name is{text}\n"


def test_placement_bundles_and_rank_order():
    cpu = PlacementConfig(worker_cpus=0.25, replica_cpus=0.1)
    assert cpu.bundles(3) == [{"CPU": 0.35}, {"CPU": 0.25}, {"CPU": 0.25}]
    assert cpu.torch_threads == 1
    gpu = PlacementConfig(use_gpu=True, worker_cpus=2, replica_cpus=1)
    assert gpu.bundles(2) == [{"CPU": 3.0, "GPU": 1.0}, {"CPU": 2.0, "GPU": 1.0}]
    # Ray placed bundles 0..3 on nodes b, a, b, a; the scheduler is on node b.
    slots = [
        WorkerSlot(i, node, ip)
        for i, (node, ip) in enumerate(
            [("b", "10.0.0.2"), ("a", "10.0.0.1"), ("b", "10.0.0.2"), ("a", "10.0.0.1")]
        )
    ]
    order = rank_order(slots, driver_node_id="b")
    assert [slots[i].bundle_index for i in order] == [0, 2, 1, 3]  # node b first, by bundle
    assert rank_order(list(reversed(slots)), "b") == [3, 1, 2, 0]  # same ranks, any order
    assert rendezvous_host(slots) is None  # two hosts: rank 0's node address
    assert rendezvous_host(slots[::2]) == "127.0.0.1"


def test_openai_requests_map_onto_sampling_params():
    completion = CompletionRequest(
        model="m", prompt=[1, 2, 3], max_tokens=5, temperature=0, stop="x", top_k=4
    )
    assert completion.prompts() == [{"prompt_token_ids": [1, 2, 3], "echo": False}]
    params = completion.sampling_params()
    assert (params.max_tokens, params.temperature, params.stop, params.top_k) == (5, 0, ("x",), 4)
    assert CompletionRequest(model="m", prompt=["one"]).prompts() == [
        {"prompt": "one", "echo": False}
    ]
    # echo with logprobs asks for the prompt's; echo with max_tokens 0 samples one token
    scored = CompletionRequest(model="m", prompt="x", echo=True, max_tokens=0, logprobs=1)
    assert scored.echo_only and scored.prompts()[0]["echo"]
    assert (scored.sampling_params().max_tokens, scored.sampling_params().prompt_logprobs) == (1, 1)
    assert (
        CompletionRequest(model="m", prompt="x", echo=True).sampling_params().prompt_logprobs
        is None
    )
    two = CompletionRequest(model="m", prompt=[[1, 2], [3]]).prompts()  # choice i * n + j
    assert [p["prompt_token_ids"] for p in two] == [[1, 2], [3]]
    assert CompletionRequest(model="m", prompt="x", logprobs=2).sampling_params().logprobs == 2
    assert CompletionRequest(model="m", prompt="x").sampling_params().logprobs is None
    with pytest.raises(ValidationError, match="logprobs"):
        CompletionRequest(model="m", prompt="x", logprobs=21)
    hi = [{"role": "user", "content": "hi"}]
    chat = ChatCompletionRequest(model="m", messages=hi, max_completion_tokens=7)
    assert chat.sampling_params().max_tokens == 7 and chat.sampling_params().logprobs is None
    chat = ChatCompletionRequest(model="m", messages=hi, logprobs=True, top_logprobs=3)
    assert chat.sampling_params().logprobs == 3
    assert (
        ChatCompletionRequest(model="m", messages=hi, logprobs=True).sampling_params().logprobs == 0
    )
    with pytest.raises(ValidationError, match="top_logprobs needs logprobs"):
        ChatCompletionRequest(model="m", messages=hi, top_logprobs=3)
    assert ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(ValidationError, match="exactly one of prompt"):
        GenerateRequest(prompt="a", prompt_token_ids=[1])
    with pytest.raises(ValidationError, match="temperature"):
        GenerateRequest(prompt="a", sampling_params={"temperature": -1})


def test_api_key_from_the_environment_is_never_silently_missing(monkeypatch):
    from cluster.serve import ServerArgs

    server = ServerArgs(api_key_env="CLUSTER_TEST_KEY")
    monkeypatch.delenv("CLUSTER_TEST_KEY", raising=False)
    with pytest.raises(ValueError, match="CLUSTER_TEST_KEY"):
        server.resolved_api_key()
    monkeypatch.setenv("CLUSTER_TEST_KEY", "sk-1")
    assert server.resolved_api_key() == "sk-1"
    assert ServerArgs().resolved_api_key() is None  # no key configured: open


RAY_SERVE_LLM = """
applications:
- name: llm_app
  route_prefix: /
  import_path: ray.serve.llm:build_openai_app
  args:
    llm_configs:
    - model_loading_config:
        model_id: smol
        model_source: {path}
      engine_kwargs:
        tensor_parallel_size: 2
        max_model_len: 512
        enable_prefix_caching: true
        speculative_config: {{method: ngram, num_speculative_tokens: 3}}
      deployment_config:
        autoscaling_config: {{min_replicas: 1, max_replicas: 2}}
        max_ongoing_requests: 16
"""


def test_ray_serve_llm_manifests_are_read_as_ours(tmp_path, smollm2_path):
    """Ray Serve LLM's `llm_configs` shape: each field we support lands where ours would
    put it; each one we do not is named in the error."""
    path = tmp_path / "serve_llm.yaml"
    path.write_text(RAY_SERVE_LLM.format(path=smollm2_path))
    manifest = load_manifest(str(path))
    args = manifest.args
    assert (args.served_model_name, args.model.path) == ("smol", smollm2_path)
    assert (args.parallel.tensor_parallel_size, args.model.max_model_len) == (2, 512)
    assert args.cache.enable_prefix_caching and args.speculative["method"] == "ngram"
    options = manifest.deployments["LLMServer"]
    assert options["autoscaling_config"]["max_replicas"] == 2
    assert options["max_ongoing_requests"] == 16
    assert read_manifest_args(str(path)).model.id == "smol"  # the offline engine's view
    for old, new, named in [
        ("max_model_len: 512", "quantization: fp8", "quantization"),
        ("model_id: smol", "model_id: smol\n        bucket_uri: s3://x", "bucket_uri"),
        (
            "      deployment_config:",
            "      runtime_env: {}\n      deployment_config:",
            "runtime_env",
        ),
    ]:
        path.write_text(RAY_SERVE_LLM.format(path=smollm2_path).replace(old, new))
        with pytest.raises(ManifestError, match=named):
            load_manifest(str(path))
