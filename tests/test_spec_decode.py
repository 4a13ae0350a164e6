"""Speculative decoding on a tiny random model: lossless for every method, oracle and
always-wrong drafts, metrics.

Greedy outputs with speculation must equal those without it (and transformers'), token
for token, for EAGLE, the normalised-fusion EAGLE, EAGLE-3, both MTP styles, n-gram and a
draft LM, at k = 1, 3, 5, in a batch that mixes chunked prefill, decode and verification.
"""

import pytest
from block_checks import assert_no_block_leaks
from greedy_reference import assert_greedy_equal, hf_greedy
from random_heads import write_all
from tiny_models import make_tiny_chat_model

from cluster import LLM, SamplingParams
from cluster.spec_decode.batch import DraftProposal

NEW_TOKENS = 24
PROMPTS = [
    [5, 6, 7],
    list(range(100, 131)),
    [9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9],
    [40, 41, 42, 43, 44, 45, 46],
]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
ENGINE = dict(
    dtype="float32", max_model_len=128, num_kv_blocks=96, block_size=4, max_num_batched_tokens=20
)


@pytest.fixture(scope="module")
def target(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("spec")
    hf = make_tiny_chat_model(str(root / "target"), smollm2_path, num_hidden_layers=4, seed=3)
    return str(root / "target"), hf, write_all(str(root / "drafts"), str(root / "target"))


@pytest.fixture(scope="module")
def baseline(target):
    path, hf, _ = target
    with LLM(path, **ENGINE) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    for prompt, ours in zip(PROMPTS, tokens, strict=True):
        assert_greedy_equal(hf, prompt, ours, hf_greedy(hf, prompt, NEW_TOKENS))
    return tokens


def _run(path, spec, k, prompts=PROMPTS, params=GREEDY):
    with LLM(path, speculative_config={**spec, "num_speculative_tokens": k}, **ENGINE) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert_no_block_leaks(llm.engine.core.block_manager)
        return [o.outputs[0] for o in outs], llm.get_metrics()


METHODS = [
    "eagle",
    "eagle_norm_fusion",
    "eagle3",
    "mtp_deepseek",
    "mtp_qwen3_next",
    "ngram",
    "draft_model",
]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_is_lossless(target, baseline, method, k):
    path, _, specs = target
    outs, metrics = _run(path, specs[method], k)
    assert [o.token_ids for o in outs] == baseline
    assert metrics["num_draft_tokens"] > 0
    assert sum(o.num_draft_tokens for o in outs) == metrics["num_draft_tokens"]


@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
def test_hybrid_drafting_is_lossless_and_uses_both_drafters(target, baseline, method):
    """The repeating prompt [9, 8, 9, ...] offers long matches (lookup drafts), the others
    mostly none (the model drafts)."""
    path, _, specs = target
    spec = {**specs[method], "hybrid_lookup_min": 2}
    with LLM(path, speculative_config={**spec, "num_speculative_tokens": 3}, **ENGINE) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        proposer = llm.engine.core.executor.worker.runner.proposer
        assert proposer.num_lookup_drafts > 0 and proposer.num_model_drafts > 0
    assert [o.outputs[0].token_ids for o in outs] == baseline


def test_run_chain_cuts_where_the_chain_probability_falls():
    """Rows with draft probabilities 0.9, 0.9, 0.9 / 0.9, 0.1, 0.9 / 0.2, ...: at 0.3 the
    chains keep 3, 1 and 0 drafts (the chain probability is a running product)."""
    import torch

    from cluster.spec_decode.chain import draft_confidence, run_chain

    vocab, n, k = 8, 3, 3
    chosen = [[0.9, 0.9, 0.9], [0.9, 0.1, 0.9], [0.2, 0.9, 0.9]]

    def logits_for(step, rows):
        # token `step` gets probability chosen[row][step], the rest share what is left
        out = torch.full((len(rows), vocab), 0.0)
        for j, r in enumerate(rows):
            p = torch.full((vocab,), (1 - chosen[r][step]) / (vocab - 1))
            p[step] = chosen[r][step]
            out[j] = p.log()
        return out

    def step_fn(tokens, hidden, positions, step):
        return logits_for(step, list(range(n))[: len(tokens)]), None

    first = logits_for(0, range(n))
    drafts, probs = run_chain(
        step_fn,
        first.argmax(-1),
        None,
        None,
        [4, 4, 4],
        torch.zeros(n, 4, dtype=torch.long),
        [4, 4, 4],
        4,
        None,
        [SamplingParams(temperature=1.0)] * n,
        {},
        k,
        False,
        0.3,
        draft_confidence(first, first.argmax(-1)),
    )
    assert drafts == [[0, 1, 2], [0], []]
    assert probs == [None, None, None]  # argmax drafts: verified as point masses


class ScriptedProposer:
    """Proposes, for each request, the next k tokens of a known greedy continuation, or
    (with `wrong`) a token guaranteed to differ from it."""

    needs_token_history = True

    def __init__(
        self, continuations: dict[tuple[int, ...], list[int]], k: int, vocab: int, wrong: bool
    ) -> None:
        self.continuations, self.k, self.vocab, self.wrong = continuations, k, vocab, wrong

    def propose(self, batch):
        drafts = []
        for history, sampled in zip(batch.token_history, batch.sampled, strict=True):
            if not sampled:
                drafts.append([])
                continue
            prompt = next(p for p in self.continuations if tuple(history[: len(p)]) == p)
            done = len(history) - len(prompt)
            right = self.continuations[prompt][done : done + self.k]
            drafts.append([(t + 1) % self.vocab for t in right] if self.wrong else right)
        return DraftProposal(drafts, [None] * len(drafts))


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("wrong", [False, True])
def test_oracle_and_always_wrong_drafts(target, baseline, k, wrong):
    path, hf, _ = target
    # max_tokens = 1 + m (k + 1): after the prefill's token, every step has room for k drafts.
    steps = 4
    params = SamplingParams(temperature=0, max_tokens=1 + steps * (k + 1), ignore_eos=True)
    continuations = {tuple(p): b for p, b in zip(PROMPTS, baseline, strict=True)}
    with LLM(
        path, speculative_config={"method": "ngram", "num_speculative_tokens": k}, **ENGINE
    ) as llm:
        llm.engine.core.executor.worker.runner.proposer = ScriptedProposer(
            continuations, k, hf.config.vocab_size, wrong
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        metrics = llm.get_metrics()
    for out, base in zip(outs, baseline, strict=True):
        assert out.outputs[0].token_ids == base[: params.max_tokens]
    if wrong:  # one token per step; the last step has no room for drafts
        assert metrics["num_drafts"] == (params.max_tokens - 2) * len(PROMPTS)
        assert metrics["acceptance_rate"] == 0.0 and metrics["mean_acceptance_length"] == 1.0
        assert metrics["acceptance_per_position"] == [0.0] * k
    else:
        assert metrics["num_drafts"] == steps * len(PROMPTS)
        assert metrics["acceptance_rate"] == 1.0 and metrics["mean_acceptance_length"] == k + 1
        assert metrics["acceptance_per_position"] == [1.0] * k
        assert all(o.outputs[0].num_accepted_tokens == steps * k for o in outs)


def test_drafts_respect_max_tokens_and_stop_inside_an_accepted_run(target, baseline):
    path, hf, _ = target
    k = 4
    continuations = {tuple(p): b for p, b in zip(PROMPTS, baseline, strict=True)}
    stop_token = baseline[1][6]  # a stop token id in the middle of an accepted run
    first = baseline[1].index(stop_token)
    params = [
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_token]),
    ]
    with LLM(
        path, speculative_config={"method": "ngram", "num_speculative_tokens": k}, **ENGINE
    ) as llm:
        llm.engine.core.executor.worker.runner.proposer = ScriptedProposer(
            continuations, k, hf.config.vocab_size, False
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, use_tqdm=False)
        assert_no_block_leaks(llm.engine.core.block_manager)
    assert outs[0].outputs[0].token_ids == baseline[0][:7]
    assert outs[1].outputs[0].token_ids == baseline[1][: first + 1]
    assert outs[1].outputs[0].finish_reason == "stop"


def test_extreme_sampling_values_share_a_batch_safely(target, baseline):
    """Legal but extreme values, in one batch with a greedy request and EAGLE-3 drafts:
    nothing fails, the greedy neighbour is untouched, and the limits mean what they say."""
    path, _, specs = target
    prompt = PROMPTS[0]

    def vary(params, **update):  # validated (model_copy would skip the validators)
        return SamplingParams(**{**params.model_dump(), **update})

    sampled = vary(GREEDY, temperature=1.0, seed=7)
    forced = 17  # +100 on one token: every step picks it
    extreme = [
        GREEDY,
        vary(sampled, top_p=5e-324),  # only the argmax survives
        vary(sampled, min_p=1.0),  # likewise
        vary(sampled, temperature=1e308),
        vary(sampled, temperature=1.01e-5),
        vary(sampled, top_k=2**31 - 1),
        vary(sampled, repetition_penalty=1e-300),
        vary(sampled, repetition_penalty=1e300),
        vary(sampled, presence_penalty=2, frequency_penalty=-2),
        vary(GREEDY, logit_bias={str(forced): 100}),
        vary(sampled, logit_bias={str(t): -100 for t in range(50)}),
    ]
    outs, _ = _run(path, specs["eagle3"], 3, [prompt] * len(extreme), extreme)
    tokens = [o.token_ids for o in outs]
    assert all(len(t) == NEW_TOKENS for t in tokens)  # every request ran to the end
    assert all(0 <= x < 49152 for t in tokens for x in t)  # the vocabulary
    assert tokens[0] == tokens[1] == tokens[2] == baseline[0]
    assert tokens[9] == [forced] * NEW_TOKENS
    assert all(x >= 50 for x in tokens[10])
