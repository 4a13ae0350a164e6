"""Qwen2, Qwen3 (q/k norms, YaRN), Qwen3-MoE, Mistral, DeepSeek-V3 and Qwen3-Next targets
equal transformers on tiny random checkpoints: logits (float32, < 1e-4) at TP=1 and TP=2
for a batch of different lengths and across prefill chunks, greedy generation token for
token through the engine (chunked prefill, prefix caching), speculation lossless on them;
configs the engine cannot serve exactly are refused when the configuration is built.
(Qwen3-Next's recurrent state and MTP head: `test_qwen3_next.py`.)"""

import json
import os

import pytest
import torch
from forward_helpers import prefill
from mtp_oracle import make_oracle
from random_heads import write_all, write_deepseek_mtp
from tiny_models import FAMILIES, hf_logits, make_tiny_family
from tp_workers import model_logits, spawn_ranks
from transformers import AutoTokenizer

from cluster import LLM, SamplingParams
from cluster.config import ModelConfig, engine_config_from_args
from cluster.config.architectures import TARGET_ARCHITECTURES
from cluster.kernels.fused_moe import fused_moe_ref
from cluster.models.loader import load_model
from cluster.models.moe import experts_by_expert
from cluster.models.registry import model_class, supported_architectures
from cluster.parallel import ParallelState
from cluster.worker.kv_cache import PagedKVCache

TOL = 1e-4
SEQ_LENS = [1, 7, 19, 4]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, smollm2_path):
    """family -> (path, hf model); each folder carries a tokenizer so the engine runs."""
    root = tmp_path_factory.mktemp("families")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    out = {}
    for i, family in enumerate(FAMILIES):
        path = str(root / family)
        out[family] = (path, make_tiny_family(path, family, seed=10 + i))
        tokenizer.save_pretrained(path)
    return out


def _batch(vocab_size, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g) for n in SEQ_LENS]


def test_every_architecture_has_a_model_class():
    """Each served name (written once, in the config layer) resolves to a model class of
    that name."""
    assert supported_architectures() == sorted(TARGET_ARCHITECTURES)
    for name in TARGET_ARCHITECTURES:
        cls = model_class(name)
        assert cls.__name__ == name and issubclass(cls, torch.nn.Module)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp1_logits_match_transformers(checkpoints, family):
    path, hf = checkpoints[family]
    seqs = _batch(hf.config.vocab_size, seed=1)
    model = load_model(ModelConfig(path=path, dtype="float32"), ParallelState.single(), False)
    assert type(model).__name__ == hf.config.architectures[0]
    with torch.no_grad():
        logits = model.compute_logits(prefill(model, torch.cat(seqs), SEQ_LENS))
    for ours, ref in zip(logits.split(SEQ_LENS), hf_logits(hf, seqs), strict=True):
        assert (ours - ref).abs().max().item() < TOL


def test_tp2_logits_match_transformers(checkpoints):
    names = list(FAMILIES)
    seqs = _batch(min(checkpoints[n][1].config.vocab_size for n in names), seed=2)
    paths = [checkpoints[n][0] for n in names]
    per_rank = spawn_ranks(model_logits, 2, args=(2, paths, [s.tolist() for s in seqs]))
    for i, name in enumerate(names):
        refs = hf_logits(checkpoints[name][1], seqs)
        for rank_logits in per_rank:
            for ours, ref in zip(rank_logits[i].split(SEQ_LENS), refs, strict=True):
                assert (ours - ref).abs().max().item() < TOL, name


def test_expert_parallel_logits_match_transformers(checkpoints):
    """EP=2 (whole experts per rank, tokens exchanged by all-to-all over gloo) on every
    MoE family; the two ranks dispatch different halves of the tokens."""
    names = [n for n in FAMILIES if "moe" in n or "deepseek" in n or "next" in n]
    seqs = _batch(min(checkpoints[n][1].config.vocab_size for n in names), seed=3)
    paths = [checkpoints[n][0] for n in names]
    per_rank = spawn_ranks(model_logits, 2, args=(2, paths, [s.tolist() for s in seqs], 2))
    for i, name in enumerate(names):
        refs = hf_logits(checkpoints[name][1], seqs)
        for rank_logits in per_rank:
            for ours, ref in zip(rank_logits[i].split(SEQ_LENS), refs, strict=True):
                assert (ours - ref).abs().max().item() < TOL, name


ENGINE = dict(
    dtype="float32", max_model_len=384, num_kv_blocks=256, block_size=4, max_num_batched_tokens=8
)
PROMPTS = [[5, 9, 33, 71, 2, 18, 100, 41, 7, 7, 19], [200, 3, 4], [5, 9, 33, 71, 2, 18, 100]]
NEW_TOKENS = 10


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_next"])
def test_logits_across_prefill_chunks_equal_transformers(checkpoints, family):
    """Every prompt position's logprob, computed in chunks of 8 tokens (the latent cache,
    the recurrent states carried from chunk to chunk)."""
    path, hf = checkpoints[family]
    prompts = [list(range(3, 40)), PROMPTS[0]]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    with LLM(path, **ENGINE) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            reference = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
        entries = zip(prompt[1:], out.prompt_logprobs[1:], strict=True)
        ours = [entry[t].logprob for t, entry in entries]
        expected = reference[torch.arange(len(prompt) - 1), prompt[1:]]
        assert (torch.tensor(ours) - expected).abs().max() < TOL


def _hf_greedy(hf, prompt):
    """transformers' greedy tokens, each from a full forward over everything before it
    (no KV cache: its incremental path is not the oracle)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def _greedy(path, spec=None, prompts=PROMPTS):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    spec = {**spec, "num_speculative_tokens": 3} if spec else None
    with LLM(path, speculative_config=spec, **ENGINE) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0] for o in outs]


@pytest.mark.parametrize(
    "family",
    [
        "qwen2",
        "qwen3_yarn_bias",
        "mistral",
        "qwen3_moe",
        "deepseek_v3_yarn_no_q_lora",
        "qwen3_next",
    ],
)
def test_greedy_generation_equals_transformers(checkpoints, family):
    path, hf = checkpoints[family]
    outs = _greedy(path)
    assert [o.token_ids for o in outs] == [_hf_greedy(hf, p) for p in PROMPTS]


# EAGLE-3 on Qwen3, the normalised-fusion EAGLE on Qwen3-MoE, DeepSeek-V3 with its own MTP
# layers (MLA + MoE blocks, two of them), n-gram lookup on all.
SPECULATION = [
    ("qwen3", "eagle3"),
    ("qwen3_moe", "eagle_norm_fusion"),
    ("deepseek_v3", "mtp_deepseek"),
    ("deepseek_v3_yarn_no_q_lora", "mtp_deepseek"),
    ("qwen3_next", "mtp_qwen3_next"),
    *[(family, "ngram") for family in FAMILIES],
]


@pytest.mark.parametrize(("family", "method"), SPECULATION)
def test_speculation_is_lossless(checkpoints, tmp_path, family, method):
    path, hf = checkpoints[family]
    specs = write_all(str(tmp_path / "drafts"), path)
    # one prompt holds every token id, so n-gram lookup matches whatever the model says
    prompts = [*PROMPTS, list(range(hf.config.vocab_size))]
    outs = _greedy(path, specs[method], prompts)
    assert [o.token_ids for o in outs] == [_hf_greedy(hf, p) for p in prompts]
    assert sum(o.num_draft_tokens for o in outs) > 0


@pytest.mark.parametrize(
    "layout",
    [
        {"tensor_parallel_size": 2},
        {"pipeline_parallel_size": 2},
        {"tensor_parallel_size": 2, "expert_parallel_size": 2},
    ],
    ids=["tp2", "pp2", "tp2_ep2"],
)
def test_deepseek_mtp_with_parallel_ranks(checkpoints, tmp_path, layout):
    """The MTP head on the last pipeline stage (or on every TP rank; with expert
    parallelism its MoE layer's experts spread like the target's), lossless."""
    path, hf = checkpoints["deepseek_v3"]
    spec = {
        **write_all(str(tmp_path / "drafts"), path)["mtp_deepseek"],
        "num_speculative_tokens": 2,
    }
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(path, speculative_config=spec, **{**ENGINE, **layout}) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p) for p in PROMPTS]
    assert sum(o.outputs[0].num_draft_tokens for o in outs) > 0


def test_oracle_deepseek_mtp_head_is_accepted_and_lossless(tmp_path, smollm2_path):
    """Both MTP layers arranged to predict the target exactly (`mtp_oracle`): nearly
    every draft of every pass is accepted, and the output is unchanged."""
    path, mtp = str(tmp_path / "target"), str(tmp_path / "mtp")
    make_tiny_family(path, "deepseek_v3", seed=6)
    AutoTokenizer.from_pretrained(smollm2_path).save_pretrained(path)
    write_deepseek_mtp(mtp, path, num_layers=2)
    make_oracle(path, mtp, "deepseek", kept=2)  # the last of its 3 layers (an MoE one)
    base = _greedy(path)
    outs = _greedy(path, {"method": "mtp", "model": mtp})
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    drafted = sum(o.num_draft_tokens for o in outs)
    assert drafted > 0 and sum(o.num_accepted_tokens for o in outs) / drafted > 0.95


def test_mla_cache_holds_each_latent_once(checkpoints):
    """One KV 'head' of kv_lora_rank + rope dims per MLA layer, its values the keys'
    tensor: the cache is sized for it once."""
    path, _ = checkpoints["deepseek_v3"]
    with LLM(path, **ENGINE) as llm:
        cache = llm.engine.core.executor.worker.runner.kv_cache
        assert all(v is k for k, v in zip(cache.k, cache.v, strict=True))
        assert [tuple(k.shape[2:]) for k in cache.k] == [(1, 32 + 8)] * 3
        shapes = [(1, 40, True)] * 3
        assert PagedKVCache.bytes_per_block(shapes, 4, torch.float32) == 3 * 4 * 40 * 4


def test_expert_paths_agree():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 16, generator=g)
    w13, w2 = torch.randn(4, 24, 16, generator=g), torch.randn(4, 16, 12, generator=g)
    top_ids = torch.tensor([[0, 3], [3, 1], [2, 0], [1, 2], [3, 0]])
    weights = torch.rand(5, 2, generator=g)
    by_expert = experts_by_expert(x, w13, w2, top_ids, weights)
    torch.testing.assert_close(fused_moe_ref(x, w13, w2, top_ids, weights), by_expert)
    # the reference itself, one token and expert at a time
    for t in range(5):
        want = sum(
            weights[t, j]
            * (torch.nn.functional.silu(w13[e, :12] @ x[t]) * (w13[e, 12:] @ x[t]))
            @ w2[e].T
            for j, e in enumerate(top_ids[t].tolist())
        )
        torch.testing.assert_close(by_expert[t], want, atol=1e-5, rtol=1e-5)


def _edited(path, tmp_path, **changes):
    """A copy of the checkpoint's config.json with `changes`, in a new folder."""
    with open(os.path.join(path, "config.json")) as f:
        config = {**json.load(f), **changes}
    out = tmp_path / "_".join(changes)
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


@pytest.mark.parametrize(
    ("family", "changes", "args", "message"),
    [
        ("mistral", {"sliding_window": 64}, {}, r"sliding window of 64 tokens.*<= 64"),
        (
            "qwen3",
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
            {},
            r"rope_type='dynamic' is not supported",
        ),
        ("qwen2", {"hidden_act": "gelu"}, {}, r"hidden_act='gelu' is not supported"),
        (
            "qwen3_moe",
            {"moe_intermediate_size": 33},
            {"tensor_parallel_size": 2},
            r"divide the model's moe_intermediate_size=33",
        ),
        ("qwen2", {"architectures": ["GPT2LMHeadModel"]}, {}, r"are not supported"),
        (
            "qwen2",
            {"rms_norm_eps": 1e-6},
            {"tensor_parallel_size": 2, "expert_parallel_size": 2},
            r"expert_parallel_size=2 needs a mixture-of-experts model",
        ),
        (
            "qwen3_moe",
            {"rms_norm_eps": 1e-6},
            {"tensor_parallel_size": 2, "expert_parallel_size": 4},
            r"expert_parallel_size=4 must be 1 or tensor_parallel_size=2",
        ),
        (
            "qwen3_moe",
            {"num_local_experts": 5},  # transformers' name for num_experts on disk
            {"tensor_parallel_size": 2, "expert_parallel_size": 2},
            r"must divide the model's 5 experts",
        ),
    ],
)
def test_unservable_configs_are_refused_when_built(
    checkpoints, tmp_path, family, changes, args, message
):
    path = _edited(checkpoints[family][0], tmp_path, **changes)
    with pytest.raises(ValueError, match=message):
        engine_config_from_args(path, max_model_len=128, **args)
