"""Models by Hugging Face id: found in a local Hub cache (built here, offline, in the
cache's own layout), at a branch or commit `revision`, served under the id as vLLM names
it; a missing model or revision is an error that names it and says how to fetch it."""

import os
import shutil

import huggingface_hub
import pytest
from tiny_models import make_tiny_chat_model

from cluster import LLM, SamplingParams
from cluster.config import ModelConfig
from cluster.config.hub import is_hub_id, resolve_model_path
from cluster.serve.args import ClusterArgs

REPO = "tiny-org/tiny-chat"
COMMITS = ("a" * 40, "b" * 40)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, smollm2_path):
    """A Hub cache holding two commits of REPO (different weights), `main` at the second."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / f"models--{REPO.replace('/', '--')}"
    for seed, commit in enumerate(COMMITS):
        make_tiny_chat_model(str(repo / "snapshots" / commit), smollm2_path, seed=seed)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMITS[1])
    (repo / "refs" / "v1").write_text(COMMITS[0])
    return cache


@pytest.fixture
def offline(hub_cache, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return hub_cache


def test_ids_resolve_to_cached_snapshots_at_a_revision(offline):
    snapshots = offline / f"models--{REPO.replace('/', '--')}" / "snapshots"
    assert is_hub_id(REPO) and not is_hub_id(str(snapshots)) and not is_hub_id("../x")
    assert resolve_model_path(REPO) == str(snapshots / COMMITS[1])
    assert resolve_model_path(REPO, "v1") == str(snapshots / COMMITS[0])
    assert resolve_model_path(REPO, COMMITS[0]) == str(snapshots / COMMITS[0])
    config = ModelConfig(path=REPO, revision="v1")
    assert (config.path, config.revision) == (str(snapshots / COMMITS[0]), COMMITS[0])
    assert ModelConfig.model_validate(config.model_dump()) == config  # a copy re-validates
    with pytest.raises(ValueError, match="cluster download tiny-org/absent"):
        ModelConfig(path="tiny-org/absent")
    with pytest.raises(ValueError, match="revision 'v9'"):
        ModelConfig(path=REPO, revision="v9")
    with pytest.raises(ValueError, match="applies to Hugging Face ids"):
        ModelConfig(path=str(snapshots / COMMITS[1]), revision="v1")


def test_an_id_serves_the_same_tokens_as_its_folder(offline):
    folder = str(offline / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMITS[0])
    local = shutil.copytree(folder, str(offline.parent / "local-copy"), dirs_exist_ok=True)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    engine = dict(max_model_len=128, compile="off", num_kv_blocks=32)
    with LLM(REPO, revision="v1", **engine) as by_id:
        from_hub = by_id.generate(["Hello there"], greedy, use_tqdm=False)[0]
    with LLM(local, **engine) as by_folder:
        from_folder = by_folder.generate(["Hello there"], greedy, use_tqdm=False)[0]
    assert from_hub.outputs[0].token_ids == from_folder.outputs[0].token_ids
    assert os.path.isdir(local)


def test_manifests_take_ids_and_serve_them_under_the_id(offline):
    args = ClusterArgs.model_validate({"model": {"path": REPO, "revision": "v1"}})
    assert args.served_model_name == REPO
    assert args.model_path().endswith(COMMITS[0])
    assert args.engine_config().model.path.endswith(COMMITS[0])
