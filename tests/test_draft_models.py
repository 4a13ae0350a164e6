"""Draft heads: checkpoint layouts load, drafts equal an independent no-cache recompute,
and the details that are easy to get wrong (hidden source of steps 2..k, MTP layer per
step, the direction of EAGLE-3's d2t, EAGLE-3's pre-norm hidden) are pinned down."""

import pytest
import torch
from forward_helpers import draft_prefill, prefill
from random_heads import write_all
from safetensors.torch import load_file
from steered_proposer import SteeredProposer
from tiny_models import make_tiny_chat_model

from cluster import LLM, SamplingParams

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
K = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("drafts")
    target = str(root / "target")
    hf = make_tiny_chat_model(target, smollm2_path, num_hidden_layers=6, seed=5)
    return target, hf, write_all(str(root / "d"), target, seed=7)


class Recorder:
    """Wraps a proposer and keeps every (batch, proposal)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []
        self.needs_token_history = getattr(inner, "needs_token_history", False)

    def propose(self, batch):
        proposal = self.inner.propose(batch)
        self.calls.append((batch, proposal))
        return proposal


def _engine_drafts(target, spec, k=K):
    """Drafts proposed right after the prefill of PROMPT (greedy), and the sampled token."""
    with LLM(
        target,
        dtype="float32",
        max_model_len=64,
        num_kv_blocks=32,
        block_size=4,
        speculative_config={**spec, "num_speculative_tokens": k},
    ) as llm:
        worker = llm.engine.core.executor.worker
        recorder = Recorder(worker.runner.proposer)
        worker.runner.proposer = recorder
        out = llm.generate(
            {"prompt_token_ids": PROMPT},
            SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
            use_tqdm=False,
        )
        _batch, proposal = recorder.calls[0]
        return worker.draft, out[0].outputs[0].token_ids[0], proposal.token_ids[0]


@torch.no_grad()
def _reference_drafts(draft, hf, first_token):
    """No KV cache: every pass recomputes all positions. Rows before the prompt's end take
    the target's features; each later row takes the draft's own `next_hidden` from the
    row before it (its previous pass)."""
    ids = torch.tensor([PROMPT])
    states = hf(ids, output_hidden_states=True).hidden_states
    aux = getattr(draft, "aux_layers", None)
    features = torch.cat([states[i][0] for i in aux], -1) if aux else states[-1][0]
    hidden_in = draft.combine_target_hidden(features)  # [L, H]
    tokens = [*PROMPT[1:], first_token]
    drafts = []
    for step in range(K):
        logits_hidden, next_hidden = draft_prefill(draft, torch.tensor(tokens), hidden_in, step)
        token = int(draft.compute_logits(logits_hidden[-1:], step).argmax())
        drafts.append(token)
        tokens.append(token)
        hidden_in = torch.cat([hidden_in, next_hidden[-1:]])
    return drafts


@pytest.mark.parametrize("kind", ["eagle", "eagle_norm_fusion", "eagle3"])
def test_drafts_equal_a_no_cache_recompute(setup, kind):
    target, hf, specs = setup
    draft, first, drafts = _engine_drafts(target, specs[kind])
    assert len(drafts) == K
    assert drafts == _reference_drafts(draft, hf, first)


def test_reference_detects_a_wrong_hidden_source(setup):
    """Feeding the target's feature (instead of the draft's own output) to steps 2..k
    changes the drafts, so the comparison above would catch that bug."""
    target, hf, specs = setup
    draft, first, drafts = _engine_drafts(target, specs["eagle"])
    with torch.no_grad():
        states = hf(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states[-1][0]
        tokens, hidden_in, wrong = [*PROMPT[1:], first], states, []
        for step in range(K):
            lh, _ = draft_prefill(draft, torch.tensor(tokens), hidden_in, step)
            token = int(draft.compute_logits(lh[-1:], step).argmax())
            wrong.append(token)
            tokens.append(token)
            hidden_in = torch.cat(
                [hidden_in, states[-1:]]
            )  # the bug: the target's last feature again
    assert wrong != drafts


def test_checkpoint_layouts_load(setup):
    target, _, specs = setup
    for kind, tensor, param in [
        ("eagle", "fc.weight", "fc.weight"),
        ("eagle", "layers.0.mlp.down_proj.weight", "layers.0.mlp.down_proj.weight"),
        ("eagle3", "midlayer.hidden_norm.weight", "midlayer.hidden_norm.weight"),
        ("eagle3", "lm_head.weight", "lm_head.weight"),
        ("mtp_deepseek", "model.layers.7.eh_proj.weight", "model.layers.7.eh_proj.weight"),
        ("mtp_deepseek", "model.layers.6.mlp.up_proj.weight", None),
        ("mtp_qwen3_next", "mtp.fc.weight", "mtp.fc.weight"),
    ]:
        with LLM(
            target,
            dtype="float32",
            max_model_len=64,
            num_kv_blocks=32,
            speculative_config={**specs[kind], "num_speculative_tokens": 2},
        ) as llm:
            draft = llm.engine.core.executor.worker.draft
            file = "mtp.safetensors" if kind.startswith("mtp") else "model.safetensors"
            saved = load_file(f"{specs[kind]['model']}/{file}")[tensor]
            params = dict(draft.named_parameters())
            if param is None:  # a block weight of the DeepSeek layer lives under mtp_block
                up = params["model.layers.6.mtp_block.mlp.gate_up_proj.weight"]
                torch.testing.assert_close(up[up.shape[0] // 2 :], saved)
            else:
                torch.testing.assert_close(params[param], saved)
            target_model = llm.engine.core.executor.worker.model
            if (
                kind != "eagle3"
            ):  # shared with the target (EAGLE: none in the checkpoint; MTP: always)
                assert draft.lm_head is target_model.lm_head
            assert draft.embed_tokens is target_model.model.embed_tokens


def test_eagle3_d2t_direction_and_prenorm_hidden(setup):
    target, _hf, specs = setup
    with LLM(
        target,
        dtype="float32",
        max_model_len=64,
        num_kv_blocks=32,
        speculative_config={**specs["eagle3"], "num_speculative_tokens": 2},
    ) as llm:
        draft = llm.engine.core.executor.worker.draft
    d2t = load_file(f"{specs['eagle3']['model']}/model.safetensors")["d2t"]
    hidden = torch.randn(3, draft.config.hidden_size)
    with torch.no_grad():
        logits = draft.compute_logits(hidden, 0)  # [3, target_vocab]
        draft_logits = draft.lm_head(hidden)  # [3, draft_vocab]
        best = draft_logits.argmax(-1)
        # target = draft + d2t[draft]; the reverse direction would pick other ids
        assert torch.equal(logits.argmax(-1), best + d2t[best])
        assert torch.isinf(logits).sum(-1).eq(logits.shape[1] - d2t.shape[0]).all()
        # the hidden handed to the next pass is the layer's pre-norm output
        ids = torch.tensor([3, 4, 5])
        normed, next_hidden = draft_prefill(draft, ids, hidden, 1)
        x, residual = prefill(
            lambda i, pos: draft.midlayer(pos, draft.embed_tokens(i), hidden), ids, [3]
        )
        torch.testing.assert_close(next_hidden, x + residual)
        torch.testing.assert_close(normed, draft.norm(x + residual))


def test_mtp_layer_per_step(setup):
    """Pass s uses MTP layer s % num_layers (DeepSeek style, 2 layers here)."""
    target, _, specs = setup
    with LLM(
        target,
        dtype="float32",
        max_model_len=64,
        num_kv_blocks=32,
        speculative_config={**specs["mtp_deepseek"], "num_speculative_tokens": 3},
    ) as llm:
        draft = llm.engine.core.executor.worker.draft
    assert draft.num_attention_layers == 2
    ids, hidden = torch.tensor([3, 4]), torch.randn(2, draft.config.hidden_size)
    with torch.no_grad():
        outputs = [draft_prefill(draft, ids, hidden, step)[0] for step in range(4)]
        for step, out in enumerate(outputs):
            layer = draft.model.layers[str(draft.first_layer_idx + step % 2)]
            fused = torch.cat([layer.enorm(draft.embed_tokens(ids)), layer.hnorm(hidden)], -1)
            block = layer.mtp_block
            h, residual = prefill(
                lambda i, pos, block=block, fused=fused, layer=layer: block(
                    block.self_attn.rope(pos, fused.dtype), layer.eh_proj(fused), None
                ),
                ids,
                [2],
            )
            torch.testing.assert_close(out, h + residual)
            logits = draft.compute_logits(out, step)
            torch.testing.assert_close(logits, draft.lm_head(layer.shared_head.norm(out)))
    assert not torch.allclose(outputs[0], outputs[1])
    torch.testing.assert_close(outputs[0], outputs[2])


def test_proposer_runs_pass_s_with_step_s(setup):
    target, _, specs = setup
    with LLM(
        target,
        dtype="float32",
        max_model_len=64,
        num_kv_blocks=32,
        speculative_config={**specs["mtp_deepseek"], "num_speculative_tokens": 3},
    ) as llm:
        draft = llm.engine.core.executor.worker.draft
        kinds, steps = [], []
        forward, compute_logits = draft.forward, draft.compute_logits

        def recording_forward(input_ids, hidden, positions, kind):
            kinds.append(kind)
            return forward(input_ids, hidden, positions, kind)

        def recording_logits(hidden, step):
            steps.append(step)
            return compute_logits(hidden, step)

        draft.forward, draft.compute_logits = recording_forward, recording_logits
        llm.generate(
            {"prompt_token_ids": PROMPT},
            SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
            use_tqdm=False,
        )
    # Pass s runs layer s % 2 (the forward depends on s only through that) and its head;
    # after pass 0, layer 1 writes its KV at the verified positions (`kinds[1]`).
    assert steps[:3] == [0, 1, 2]
    assert kinds[:4] == [0, 1, 1, 0]


@torch.no_grad()
def _mtp_reference_drafts(draft, hf, history, k):
    """A multi-layer MTP head without a KV cache (k <= its layers): pass s runs layer s
    over positions 0..L+s, position q taking the token after q and pass s - 1's output
    at q - 1 (at 0 for q = 0; the target's feature at q for pass 0)."""
    states = hf(torch.tensor([history[:-1]]), output_hidden_states=True).hidden_states
    hidden = draft.combine_target_hidden(states[-1][0])  # [L + 1, H]
    tokens, drafts = history[1:], []
    for step in range(k):
        logits_hidden, out = draft_prefill(draft, torch.tensor(tokens), hidden, step)
        drafts.append(int(draft.compute_logits(logits_hidden[-1:], step).argmax()))
        tokens = [*tokens, drafts[-1]]
        hidden = torch.cat([out[:1], out])  # position q reads q - 1 (0 reads 0)
    return drafts


def test_multi_layer_mtp_drafts_equal_a_recompute_after_prefill(setup):
    target, hf, specs = setup
    draft, first, drafts = _engine_drafts(target, specs["mtp_deepseek"], k=2)
    assert draft.num_attention_layers == 2
    assert drafts == _mtp_reference_drafts(draft, hf, [*PROMPT, first], 2)


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "mtp_deepseek"])
def test_drafts_after_partial_acceptance_equal_a_recompute(setup, kind):
    """Steps accept 0..k drafts, prompts come in chunks; the drafts always equal a
    recompute (for the 2-layer MTP head: every layer's KV at every position, the first
    row of a step reading what the step before kept)."""
    target, hf, specs = setup
    k = 2 if kind.startswith("mtp") else K
    prompts = [PROMPT, list(range(30, 52))]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine = dict(
        dtype="float32", max_model_len=64, num_kv_blocks=64, block_size=4, max_num_batched_tokens=12
    )
    with LLM(target, **engine) as llm:
        base = [
            o.outputs[0].token_ids
            for o in llm.generate(
                [{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False
            )
        ]
    with LLM(
        target, speculative_config={**specs[kind], "num_speculative_tokens": k}, **engine
    ) as llm:
        worker = llm.engine.core.executor.worker
        steered = SteeredProposer(
            worker.runner.proposer,
            {tuple(p): b for p, b in zip(prompts, base, strict=True)},
            k,
            hf.config.vocab_size,
        )
        worker.runner.proposer = steered
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        accepted = llm.get_metrics()["acceptance_per_position"]
        draft = worker.draft
    assert [o.outputs[0].token_ids for o in outs] == base
    assert 0 < accepted[0] < 1 and accepted[-1] > 0  # steps accepted some, none and all drafts
    aux = getattr(draft, "aux_layers", None)
    for history, real in steered.calls:
        if kind.startswith("mtp"):
            assert real == _mtp_reference_drafts(draft, hf, history, len(real)), (
                len(history),
                steered.calls.index((history, real)),
            )
            continue
        with torch.no_grad():
            states = hf(torch.tensor([history[:-1]]), output_hidden_states=True).hidden_states
            features = torch.cat([states[i][0] for i in aux], -1) if aux else states[-1][0]
            hidden_in = draft.combine_target_hidden(features)
            tokens, expected = history[1:], []
            for step in range(len(real)):
                lh, nh = draft_prefill(draft, torch.tensor(tokens), hidden_in, step)
                token = int(draft.compute_logits(lh[-1:], step).argmax())
                expected.append(token)
                tokens = [*tokens, token]
                hidden_in = torch.cat([hidden_in, nh[-1:]])
        assert real == expected
