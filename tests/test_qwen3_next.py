"""Qwen3-Next's recurrent layers and its MTP head through the engine.

- The gated delta rule (`cluster.models.gated_delta`) equals transformers' chunked kernel
  and convolution, whole and when a sequence arrives in pieces through the state cache.
- After steps that accept 0..k drafts, with chunked prompts, every request resumes from
  exactly the state transformers has after the tokens the request kept.
- The MTP head in its public layout: with weights arranged so that it predicts what the
  target will say, nearly every draft is accepted, and the output is unchanged; it is
  lossless at TP=2 and PP=2, and through preemption.
"""

from __future__ import annotations

import pytest
import torch
from mtp_oracle import make_oracle
from random_heads import write_qwen3_next_mtp
from steered_proposer import SteeredProposer
from tiny_models import FAMILIES, make_tiny_family
from transformers.models.qwen3_next import modeling_qwen3_next as hf_qwen3_next

from cluster import LLM, SamplingParams
from cluster.engine.messages import ScheduledRequest
from cluster.models.attention import AttentionMetadata, attention_context
from cluster.models.gated_delta import RecurrentShape, gated_delta_ref
from cluster.worker.state_cache import RecurrentStateCache

ENGINE = dict(
    dtype="float32", max_model_len=128, num_kv_blocks=128, block_size=4, max_num_batched_tokens=8
)
PROMPTS = [[5, 9, 33, 71, 2, 18, 100, 41, 7, 7, 19], [200, 3, 4], list(range(30, 52))]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
TOL = 1e-4


@pytest.fixture(scope="module")
def target(tmp_path_factory, smollm2_path):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("qwen3_next")
    path = str(root / "target")
    hf = make_tiny_family(path, "qwen3_next", seed=21)
    AutoTokenizer.from_pretrained(smollm2_path).save_pretrained(path)
    mtp = write_qwen3_next_mtp(str(root / "mtp"), path, seed=4)
    return path, hf, {"method": "mtp", "model": mtp}


def _generate(path, spec=None, prompts=PROMPTS, **engine):
    with LLM(path, speculative_config=spec, **{**ENGINE, **engine}) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        preemptions = llm.engine.core.scheduler.num_preemptions
    return [o.outputs[0] for o in outs], preemptions


@pytest.fixture(scope="module")
def baseline(target):
    outs, _ = _generate(target[0])
    return [o.token_ids for o in outs]


# ---- the kernel against transformers' ------------------------------------------------------


def _hf_delta(mixed, g, beta, weight, nk, dk, dv):
    """transformers' causal conv and chunked gated delta rule over one whole sequence."""
    conv = hf_qwen3_next.causal_conv1d_fn(mixed.T[None], weight, None, activation="silu")
    q, k, v = conv[0].T.split([nk * dk, nk * dk, v_size := g.shape[1] * dv], dim=-1)
    out, state = hf_qwen3_next.torch_chunk_gated_delta_rule(
        q.reshape(1, -1, nk, dk),
        k.reshape(1, -1, nk, dk),
        v.reshape(1, -1, v_size // dv, dv),
        g=g[None],
        beta=beta[None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return out[0], state[0]


def _random_inputs(n, nk=2, dk=8, heads=4, dv=6, kernel=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    conv_dim = 2 * nk * dk + heads * dv
    mixed = torch.randn(n, conv_dim, generator=gen)
    g = -torch.rand(n, heads, generator=gen)
    beta = torch.rand(n, heads, generator=gen)
    weight = torch.randn(conv_dim, kernel, generator=gen) * 0.5
    return mixed, g, beta, weight


def test_gated_delta_equals_transformers_whole_and_in_pieces():
    nk, dk, heads, dv, kernel = 2, 8, 4, 6, 4
    lens = [1, 9, 70]  # 70 spans two of transformers' 64-token chunks
    inputs = [_random_inputs(n, seed=i) for i, n in enumerate(lens)]
    weight = inputs[0][3]
    refs = [_hf_delta(m, g, b, weight, nk, dk, dv) for m, g, b, _ in inputs]
    # the three sequences side by side, from zero states
    meta = AttentionMetadata.for_prefill(lens)
    with attention_context(meta):
        out = gated_delta_ref(
            torch.cat([x[0] for x in inputs]),
            torch.cat([x[1] for x in inputs]),
            torch.cat([x[2] for x in inputs]),
            weight,
            0,
            nk,
            dk,
            dv,
        )
    for ours, (ref, _) in zip(out.split(lens), refs, strict=True):
        assert (ours - ref).abs().max() < TOL

    # the 70-token sequence in pieces of 5, 30 and 35 tokens through the state cache,
    # keeping the states after the last 3 tokens of each piece
    shape = RecurrentShape(2 * nk * dk + heads * dv, kernel, heads, dk, dv)
    cache = RecurrentStateCache({0: shape}, num_slots=2, num_snapshots=3, dtype=torch.float32)
    cache.add("other")
    cache.add("r")
    mixed, g, beta, _ = inputs[2]
    pieces, start = [], 0
    for n in (5, 30, 35):
        item = ScheduledRequest("r", list(range(n)), start, 0, [], False)
        step = cache.begin_step([item])
        meta = AttentionMetadata.for_prefill([n])
        meta.recurrent = step
        rows = slice(start, start + n)
        with attention_context(meta):
            pieces.append(gated_delta_ref(mixed[rows], g[rows], beta[rows], weight, 0, nk, dk, dv))
        cache.end_step(step)
        start += n
    assert (torch.cat(pieces) - refs[2][0]).abs().max() < TOL
    # the kept states are transformers' states after tokens 67, 68 and 69
    slot = cache.slot_of["r"]
    for j, upto in enumerate((68, 69, 70)):
        _, state = _hf_delta(mixed[:upto], g[:upto], beta[:upto], weight, nk, dk, dv)
        assert (cache.recurrent[0][slot, j] - state).abs().max() < TOL
        assert torch.equal(cache.conv[0][slot, j], mixed[upto - kernel + 1 : upto])
    with pytest.raises(RuntimeError, match="recurrent state is kept only after"):
        cache.begin_step([ScheduledRequest("r", [1], 66, 0, [], True)])


# ---- rollback after partial acceptance -----------------------------------------------------


def _hf_states(hf, tokens):
    """transformers' (conv, recurrent) state of every linear layer after `tokens`."""
    with torch.no_grad():
        cache = hf(torch.tensor([tokens]), use_cache=True).past_key_values
    states = {}
    for i, kind in enumerate(hf.config.layer_types):
        if kind == "linear_attention":
            states[i] = (cache.get_conv_state(i)[0], cache.get_recurrent_state(i)[0])
    return states


def test_states_after_partial_acceptance_equal_a_recompute(target, baseline):
    """Steps accept 0..k drafts and prompts come in chunks of 8; at every step each
    request resumes from transformers' state after exactly the tokens it kept."""
    path, hf, spec = target
    k = 3
    checked = []
    with LLM(path, speculative_config={**spec, "num_speculative_tokens": k}, **ENGINE) as llm:
        runner = llm.engine.core.executor.worker.runner
        runner.proposer = SteeredProposer(
            runner.proposer,
            {tuple(p): b for p, b in zip(PROMPTS, baseline, strict=True)},
            k,
            hf.config.vocab_size,
        )
        cache = runner.state_cache
        begin = cache.begin_step

        def check(scheduled):
            step = begin(scheduled)
            for i, item in enumerate(scheduled):
                if item.num_computed_tokens == 0:
                    continue
                request = runner.requests[item.req_id]
                history = (request.prompt_token_ids + request.output_token_ids)[
                    : item.num_computed_tokens
                ]
                for layer, (conv, recurrent) in _hf_states(hf, history).items():
                    ours_conv, ours_recurrent = step.read(layer)
                    assert torch.allclose(ours_conv[i], conv[:, 1:].T, atol=TOL)
                    assert (ours_recurrent[i] - recurrent).abs().max() < TOL
                checked.append(len(history))
            return step

        cache.begin_step = check
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        accepted = llm.get_metrics()["acceptance_per_position"]
    assert [o.outputs[0].token_ids for o in outs] == baseline
    assert 0 < accepted[0] < 1 and accepted[-1] > 0  # steps accepted some, none and all drafts
    assert len(checked) > 20


# ---- the MTP head ----------------------------------------------------------------------------


def hf_layer_types():
    return FAMILIES["qwen3_next"][1]["layer_types"]


def test_oracle_mtp_head_is_accepted_and_lossless(tmp_path, smollm2_path):
    from transformers import AutoTokenizer

    path, mtp = str(tmp_path / "target"), str(tmp_path / "mtp")
    make_tiny_family(path, "qwen3_next", seed=5)
    AutoTokenizer.from_pretrained(smollm2_path).save_pretrained(path)
    write_qwen3_next_mtp(mtp, path, seed=1)  # (links the target's files; rewritten below)
    kept = max(i for i, t in enumerate(hf_layer_types()) if t == "full_attention")
    make_oracle(path, mtp, "qwen3_next", kept)
    base, _ = _generate(path)
    spec = {"method": "mtp", "model": mtp, "num_speculative_tokens": 3}
    outs, _ = _generate(path, spec)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    drafted = sum(o.num_draft_tokens for o in outs)
    accepted = sum(o.num_accepted_tokens for o in outs)
    assert drafted > 0 and accepted / drafted > 0.95


@pytest.mark.parametrize(
    "engine",
    [
        dict(tensor_parallel_size=2),
        dict(pipeline_parallel_size=2),
        dict(num_kv_blocks=13, max_model_len=48),  # preemption: restarts from a zero state
    ],
    ids=["tp2", "pp2", "preempted"],
)
def test_mtp_speculation_is_lossless(target, baseline, engine):
    path, _, spec = target
    outs, preemptions = _generate(path, {**spec, "num_speculative_tokens": 2}, **engine)
    assert [o.token_ids for o in outs] == baseline
    assert sum(o.num_draft_tokens for o in outs) > 0
    if "num_kv_blocks" in engine:
        assert preemptions > 0


@pytest.mark.slow
def test_compiled_engine_equals_eager(target, baseline):
    """One 16-row graph runs every step (prefill chunks, decode, verification with state
    snapshots: the recurrent op is opaque, like attention) and every MTP pass."""
    path, _, spec = target
    with LLM(
        path,
        speculative_config={**spec, "num_speculative_tokens": 2},
        compile="on",
        compile_sizes=(16,),  # one graph each: every step (<= 9 rows) and draft pass pads to it
        compile_autotune=False,
        **ENGINE,
    ) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        runner = llm.engine.core.executor.worker.runner
        compiled = [runner.target_forward, *runner.proposer.forwards]
        assert all(f.ready and not f.failed and f.num_guard_misses == 0 for f in compiled)
    assert [o.outputs[0].token_ids for o in outs] == baseline


def test_recurrent_targets_refuse_what_they_cannot_keep(target, tmp_path):
    """No prefix caching (logged, not an error: it is on by default), and no recurrent
    draft LM."""
    from cluster.config import engine_config_from_args

    path, _, _ = target
    config = engine_config_from_args(path, dtype="float32", max_model_len=64)
    assert config.cache.enable_prefix_caching and not config.prefix_caching
    with pytest.raises(ValueError, match="recurrent layers"):
        engine_config_from_args(
            path,
            max_model_len=64,
            speculative_config={
                "method": "draft_model",
                "model": path,
                "num_speculative_tokens": 2,
            },
        )
