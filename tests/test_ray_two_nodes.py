"""A TP=2 Serve replica whose placement group spans two (simulated) Ray nodes."""

import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster
from ray_helpers import build_llm_app
from tiny_models import make_tiny_chat_model

from cluster import LLM, SamplingParams
from cluster.serve import ClusterArgs, GenerateRequest

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["first prompt", "a second, longer prompt"]


@pytest.fixture(scope="module")
def two_nodes():
    node = {"num_cpus": 1, "object_store_memory": 100 * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    cluster.add_node(**node)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    serve.start(proxy_location="Disabled")
    yield cluster
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


def test_tp2_replica_spread_across_two_nodes(two_nodes, tmp_path, smollm2_path):
    path = str(tmp_path / "m")
    make_tiny_chat_model(path, smollm2_path, num_hidden_layers=2)
    engine = {"dtype": "float32", "max_model_len": 128}
    args = ClusterArgs(
        model={"path": path, "device": "cpu", **engine},
        parallel={"tensor_parallel_size": 2},
        placement={"strategy": "STRICT_SPREAD", "worker_cpus": 0.5, "threads_per_worker": 1},
        cache={"num_kv_blocks": 64},
    )
    handle = serve.run(build_llm_app(args), name="spread", route_prefix=None)
    stats = handle.stats.remote().result()
    workers = stats["workers"]
    assert len({w["node_id"] for w in workers}) == 2  # one rank per node
    assert workers[0]["node_id"] == stats["node_id"]  # rank 0 beside the scheduler
    ours = [
        handle.generate.remote(GenerateRequest(prompt=p, sampling_params=GREEDY)).result()
        for p in PROMPTS
    ]
    with LLM(path, num_kv_blocks=64, **engine) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert [o.token_ids for o in ours] == reference
    assert {o.engine_id for o in ours} == {stats["engine_id"]}
