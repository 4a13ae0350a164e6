"""Sampling with speculation is lossless: the first two generated tokens follow exactly
the distribution they follow without it.

A tiny target with a 32-token vocabulary and peaked distributions; a random draft LM
proposes k = 3 tokens, either sampled from its own distribution (handed to the rejection
sampler as `draft_probs`) or as argmax deltas. The second token is what verification
produces, so a wrong acceptance rule or residual shows up in the joint distribution of
(token 1, token 2). Each run draws N = 8000 seeded requests; the joint counts are compared
with the exact distribution computed from the model (chi-square goodness of fit over
cells pooled to expected counts >= 5; the test fails when p < 1e-3).
"""

import pytest
import torch
from random_heads import write_draft_lm
from scipy.stats import chisquare
from tiny_models import make_tiny_chat_model

from cluster import LLM, SamplingParams

N = 8000
VOCAB = 32
PROMPT = [3, 17, 9, 4]
ENGINE = dict(
    dtype="float32",
    max_model_len=32,
    num_kv_blocks=2048,
    block_size=4,
    max_num_seqs=512,
    max_num_batched_tokens=4096,
)


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("sampled")
    target = str(root / "target")
    hf = make_tiny_chat_model(target, smollm2_path, vocab_size=VOCAB, num_hidden_layers=2, seed=11)
    # Sharpen the target so p is far from the draft's q (a wrong residual then shows).
    state = hf.state_dict()
    state["lm_head.weight"] = state["lm_head.weight"] * 25
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, f"{target}/model.safetensors")
    hf.load_state_dict(state)
    draft = write_draft_lm(str(root / "draft"), target, seed=12)
    return target, hf, draft


def _filtered_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # mass of strictly more likely tokens
        keep = torch.zeros_like(probs, dtype=torch.bool)
        keep[order[before < top_p]] = True
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum()
    return probs


@torch.no_grad()
def _exact_joint(hf, temperature: float, top_p: float) -> torch.Tensor:
    """[VOCAB, VOCAB]: P(token 1 = a, token 2 = b)."""
    first = _filtered_probs(hf(torch.tensor([PROMPT])).logits[0, -1], temperature, top_p)
    batch = torch.tensor([[*PROMPT, a] for a in range(VOCAB)])
    second = torch.stack(
        [_filtered_probs(row, temperature, top_p) for row in hf(batch).logits[:, -1]]
    )
    return first[:, None] * second


def _sample_joint(target, spec, temperature, top_p) -> torch.Tensor:
    params = [
        # max_tokens=3: after the prefill's token there is room for drafts (k + 1 <= room),
        # so the second token comes out of verification.
        SamplingParams(
            temperature=temperature, top_p=top_p, seed=seed, max_tokens=3, ignore_eos=True
        )
        for seed in range(N)
    ]
    with LLM(target, speculative_config=spec, **ENGINE) as llm:
        outs = llm.generate([{"prompt_token_ids": PROMPT}] * N, params, use_tqdm=False)
        if spec is not None:
            assert llm.get_metrics()["num_draft_tokens"] >= N  # verification really happened
    counts = torch.zeros(VOCAB, VOCAB)
    for out in outs:
        a, b = out.outputs[0].token_ids[:2]
        counts[a, b] += 1
    return counts


def _p_value(counts: torch.Tensor, exact: torch.Tensor) -> float:
    expected = (exact * counts.sum()).flatten()
    observed = counts.flatten()
    assert observed[expected == 0].sum() == 0, "a token outside the target's support was produced"
    order = expected.argsort(descending=True)
    big = expected[order] >= 5
    obs = torch.cat([observed[order][big], observed[order][~big].sum()[None]])
    exp = torch.cat([expected[order][big], expected[order][~big].sum()[None]])
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


@pytest.mark.slow
@pytest.mark.parametrize(
    "draft_sampling, top_p, options",
    # (The sampler alone, without speculation, has its own distribution tests.) The last:
    # a first token that occurs in the prompt drafts by lookup (point masses), the others
    # by the draft LM (its distributions), in the same batch, their chains cut where the
    # draft's confidence falls below 0.02 (mostly one model draft, its distribution cut too).
    [
        ("sample", 1.0, {}),
        ("sample", 0.9, {}),
        ("greedy", 1.0, {}),
        ("sample", 1.0, {"hybrid_lookup_min": 1, "min_draft_confidence": 0.02}),
    ],
)
def test_first_two_tokens_follow_the_target(models, draft_sampling, top_p, options):
    target, hf, draft = models
    spec = {
        "method": "draft_model",
        "model": draft,
        "num_speculative_tokens": 3,
        "draft_sampling": draft_sampling,
        **options,
    }
    counts = _sample_joint(target, spec, 1.0, top_p)
    exact = _exact_joint(hf, 1.0, top_p)
    assert _p_value(counts, exact) > 1e-3


@torch.no_grad()
def test_the_check_has_power(models):
    """The same check, at the same N, rejects what the classic residual bug produces:
    recovering from p instead of max(p - q, 0) after a rejection, i.e.
    P(y) = min(p, q)(y) + P(reject) * p(y) for the verified token."""
    _, hf, draft_path = models
    from transformers import AutoModelForCausalLM

    draft = AutoModelForCausalLM.from_pretrained(draft_path, dtype=torch.float32).eval()
    exact = _exact_joint(hf, 1.0, 1.0)
    first = exact.sum(1)
    batch = torch.tensor([[*PROMPT, a] for a in range(VOCAB)])
    p = torch.softmax(hf(batch).logits[:, -1], -1)  # [VOCAB (token 1), VOCAB]
    q = torch.softmax(draft(batch).logits[:, -1], -1)
    overlap = torch.minimum(p, q)
    buggy = overlap + (1 - overlap.sum(-1, keepdim=True)) * p
    counts = (first[:, None] * buggy * N).round()
    assert _p_value(counts, exact) < 1e-6


@pytest.mark.parametrize("draft_sampling", ["sample", "greedy"])
def test_a_seeded_request_is_the_same_alone_and_in_any_batch(models, draft_sampling):
    """Sampled drafts draw from the request's own draft generator (an independent stream
    from the verifier's): neighbours, seeded or not, change nothing."""
    target, _, draft = models
    spec = {
        "method": "draft_model",
        "model": draft,
        "num_speculative_tokens": 3,
        "draft_sampling": draft_sampling,
    }
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    unseeded = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    other_seed = SamplingParams(temperature=0.7, seed=5, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in (PROMPT, [3, 4], PROMPT, [5, 6, 7])]
    with LLM(target, speculative_config=spec, **ENGINE) as llm:
        alone = llm.generate(prompts[0], seeded, use_tqdm=False)[0].outputs[0].token_ids
        for batch_params in (
            [seeded, unseeded, other_seed, unseeded],  # PROMPT is at 0 and 2
            [other_seed, unseeded, seeded, unseeded],
        ):
            outs = llm.generate(prompts, batch_params, use_tqdm=False)
            mine = batch_params.index(seeded)
            assert outs[mine].outputs[0].token_ids == alone
            assert llm.get_metrics()["num_draft_tokens"] > 0
