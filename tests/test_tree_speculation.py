"""Draft trees through the engine: greedy output unchanged, accepted paths' KV moved.

- Every drafter that can grow trees (EAGLE, EAGLE-3, both MTP layouts, a draft LM) keeps
  greedy output equal to speculation off, for dynamic trees of several shapes and a
  static tree, in batches mixing chunked prefill, decode and verification.
- Steered trees whose right path is never the first branch (so every accepted node's KV
  sits away from where the sequence continues) accept 0..k drafts and change nothing; the
  same run with the KV moves switched off goes wrong, so the check has teeth.
- TP=2 and PP=2 (the move runs on every rank, the draft on the last stage).
- Metrics are per depth, with drafts per step counting nodes.
"""

from __future__ import annotations

import pytest
import torch
from block_checks import assert_no_block_leaks
from forward_helpers import draft_prefill
from random_heads import write_all
from steered_proposer import SteeredTreeProposer
from tiny_models import make_tiny_chat_model

from cluster import LLM, SamplingParams
from cluster.draft_tree import Candidate, select_tree

NEW_TOKENS = 20
PROMPTS = [
    [5, 6, 7],
    list(range(100, 131)),
    [9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9],
    [40, 41, 42, 43, 44, 45, 46],
]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
ENGINE = dict(
    dtype="float32", max_model_len=128, num_kv_blocks=128, block_size=4, max_num_batched_tokens=20
)
DYNAMIC = {"topk": 2, "num_nodes": 6}


@pytest.fixture(scope="module")
def target(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("trees")
    path = str(root / "target")
    hf = make_tiny_chat_model(path, smollm2_path, num_hidden_layers=4, seed=3)
    return path, hf, write_all(str(root / "drafts"), path)


@pytest.fixture(scope="module")
def baseline(target):
    with LLM(target[0], **ENGINE) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _run(path, spec, engine=None, steer=None):
    with LLM(path, speculative_config=spec, **{**ENGINE, **(engine or {})}) as llm:
        if steer is not None:
            runner = llm.engine.core.executor.worker.runner
            runner.proposer = steer(runner.proposer)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        assert_no_block_leaks(llm.engine.core.block_manager)
        return [o.outputs[0] for o in outs], llm.get_metrics()


@pytest.mark.parametrize(
    ("kind", "tree", "k"),
    [
        ("eagle", DYNAMIC, 3),
        ("eagle3", {"topk": 3, "num_nodes": 4}, 2),
        ("mtp_deepseek", DYNAMIC, 3),
        ("mtp_qwen3_next", {"topk": 2, "num_nodes": 9}, 4),
        ("draft_model", DYNAMIC, 3),
        ("eagle", {"paths": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]}, 3),
    ],
    ids=["eagle", "eagle3", "mtp_deepseek", "mtp_qwen3_next", "draft_model", "eagle_static"],
)
def test_tree_drafting_is_lossless(target, baseline, kind, tree, k):
    path, _, specs = target
    outs, metrics = _run(path, {**specs[kind], "num_speculative_tokens": k, "tree": tree})
    assert [o.token_ids for o in outs] == baseline
    nodes = tree.get("num_nodes") or len(tree["paths"])
    assert 1 < metrics["mean_draft_tokens_per_step"] <= nodes
    assert len(metrics["acceptance_per_position"]) <= k  # per depth, not per node


def _steer(target, baseline, k):
    _, hf, _ = target
    continuations = {tuple(p): b for p, b in zip(PROMPTS, baseline, strict=True)}
    return lambda inner: SteeredTreeProposer(inner, continuations, k, hf.config.vocab_size)


@pytest.mark.parametrize(
    "engine",
    [{}, {"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}],
    ids=["tp1", "tp2", "pp2"],
)
def test_accepted_paths_off_the_first_branch_are_lossless(target, baseline, engine):
    path, _, specs = target
    spec = {**specs["eagle"], "num_speculative_tokens": 3, "tree": DYNAMIC}
    steer = _steer(target, baseline, 3) if not engine else None
    outs, metrics = _run(path, spec, engine, steer)
    assert [o.token_ids for o in outs] == baseline
    if steer is not None:
        accepted = metrics["acceptance_per_position"]
        assert 0 < accepted[0] < 1 and accepted[-1] > 0  # steps accepted some, none and all


def test_without_the_kv_moves_the_steered_run_goes_wrong(target, baseline, monkeypatch):
    from cluster.worker.kv_cache import PagedKVCache

    monkeypatch.setattr(PagedKVCache, "copy_slots", lambda self, copies, layers: None)
    path, _, specs = target
    spec = {**specs["eagle"], "num_speculative_tokens": 3, "tree": DYNAMIC}
    outs, _ = _run(path, spec, steer=_steer(target, baseline, 3))
    assert [o.token_ids for o in outs] != baseline


def test_tree_configs_are_checked(target):
    from cluster.config.speculative import SpeculativeConfig

    _, _, specs = target
    eagle = {**specs["eagle"], "num_speculative_tokens": 3}
    bad = [
        (3, {"topk": 2, "num_nodes": 11}, "exceeds the 10 candidates"),
        (3, {"topk": 2}, r"num_nodes \(dynamic\) or paths"),
        (3, {"paths": [[0], [0, 1]]}, r"must be 0\.\.0"),
        (3, {"paths": [[0, 0]]}, "has no parent"),
        (3, {"paths": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]}, "deeper than"),
        (5, {"topk": 16, "num_nodes": 20}, "feeds 64 nodes"),
    ]
    for k, tree, message in bad:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig(**{**eagle, "num_speculative_tokens": k}, tree=tree)
    with pytest.raises(ValueError, match="n-gram"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=3, tree=DYNAMIC)
    chain = SpeculativeConfig(**eagle, tree={"topk": 1, "num_nodes": 3})
    assert chain.tree.size == 3


@torch.no_grad()
def _recomputed_tree(draft, hf, history, k, topk, num_nodes):
    """EAGLE-2's tree for `history`, every node's draft distribution computed from scratch
    over the whole sequence (target features, then the draft's own outputs along the
    node's path)."""
    aux = getattr(draft, "aux_layers", None)
    states = hf(torch.tensor([history[:-1]]), output_hidden_states=True).hidden_states
    features = torch.cat([states[i][0] for i in aux], -1) if aux else states[-1][0]
    hidden_in = draft.combine_target_hidden(features)
    base = history[1:]

    def expand(tokens, hidden, step):
        lh, nh = draft_prefill(
            draft, torch.tensor(base + tokens), torch.cat([hidden_in, *hidden]), step
        )
        return torch.log_softmax(draft.compute_logits(lh[-1:], step)[0].float(), -1), nh[-1:]

    candidates, paths = [], []  # paths: (tokens, hidden outputs along the way)
    logp, out = expand([], [], 0)
    frontier = [(-1, [], [out])]
    for depth in range(1, k + 1):
        made = []
        for parent, tokens, hidden in frontier:
            if parent >= 0:
                logp, out = expand(tokens, hidden[:-1], depth - 1)
                hidden = [*hidden[:-1], out]
            base_score = candidates[parent].score if parent >= 0 else 0.0
            for t in logp.topk(topk).indices.tolist():
                candidates.append(Candidate(parent, t, base_score + float(logp[t])))
                paths.append(([*tokens, t], [*hidden, None]))
                made.append(len(candidates) - 1)
        best = sorted(made, key=lambda c: (-candidates[c].score, c))[:topk]
        frontier = [(c, paths[c][0], paths[c][1]) for c in best]
    tree, _ = select_tree(candidates, num_nodes)
    return list(tree.tokens), list(tree.parents)


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "mtp_qwen3_next"])
def test_trees_after_partial_acceptance_equal_a_recompute(target, baseline, kind):
    """Steps accept 0..k drafts along off-chain paths; every tree the drafter grows is the
    tree a from-scratch recompute grows (its pass 0 saw the accepted path as a chain, its
    tree passes saw exactly their ancestors)."""
    path, hf, specs = target
    k, topk, num_nodes = 3, 2, 6
    spec = {
        **specs[kind],
        "num_speculative_tokens": k,
        "tree": {"topk": topk, "num_nodes": num_nodes},
    }
    steered = []

    def steer(inner):
        steered.append(_steer(target, baseline, k)(inner))
        return steered[0]

    with LLM(path, speculative_config=spec, **ENGINE) as llm:
        runner = llm.engine.core.executor.worker.runner
        runner.proposer = steer(runner.proposer)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        draft = llm.engine.core.executor.worker.draft
    assert [o.outputs[0].token_ids for o in outs] == baseline
    calls = steered[0].calls
    assert len(calls) > 20
    for history, tokens, parents in calls[::3]:  # (every third: the recompute is slow)
        assert (tokens, parents) == _recomputed_tree(draft, hf, history, k, topk, num_nodes)


def test_sampled_trees_keep_the_target_distribution(target):
    """300 seeded requests, top-k 5 at temperature 1: the first two tokens (the second
    verified against a tree of sampled siblings: with one token left, the tree keeps its
    first depth) are distributed as without speculation (two-sample chi-square on the
    joint, p > 1e-3); a seeded request repeats itself."""
    from scipy.stats import chi2_contingency

    path, _, specs = target
    prompt = {"prompt_token_ids": PROMPTS[3]}
    params = [
        SamplingParams(temperature=1.0, top_k=5, max_tokens=3, ignore_eos=True, seed=s)
        for s in range(300)
    ]
    spec = {
        **specs["eagle"],
        "num_speculative_tokens": 2,
        "tree": {"topk": 3, "num_nodes": 5},
        "draft_sampling": "sample",
    }
    counts = []
    for speculative in (None, spec):
        with LLM(
            path,
            speculative_config=speculative,
            **{**ENGINE, "max_num_seqs": 400, "num_kv_blocks": 1200},
        ) as llm:
            outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
            if speculative is not None:
                again = llm.generate([prompt], params[:1], use_tqdm=False)
                assert again[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
                assert llm.get_metrics()["num_draft_tokens"] > 0
        pairs = [tuple(o.outputs[0].token_ids[:2]) for o in outs]
        counts.append({p: pairs.count(p) for p in set(pairs)})
    cells = sorted(set(counts[0]) | set(counts[1]))
    table = [[c.get(cell, 0) for cell in cells] for c in counts]
    assert chi2_contingency(table).pvalue > 1e-3
