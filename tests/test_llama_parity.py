"""Our Llama equals transformers' LlamaForCausalLM on the same weights (float32, < 1e-4).

Several sequences of different lengths go through ONE flattened forward, at TP=1
in-process and at TP=2 across two gloo processes.
"""

import pytest
import torch
from forward_helpers import ContiguousKVCache, prefill
from tiny_models import VARIANTS, hf_logits, make_tiny_llama
from tp_workers import model_logits, spawn_ranks

from cluster.config import ModelConfig
from cluster.models.attention import AttentionMetadata, attention_context
from cluster.models.loader import load_model
from cluster.parallel import ParallelState

TOL = 1e-4
SEQ_LENS = [1, 7, 19, 4]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (path, hf model) for every tiny variant."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        name: (str(root / name), make_tiny_llama(str(root / name), seed=i, **overrides))
        for i, (name, overrides) in enumerate(VARIANTS.items())
    }


def _batch(vocab_size: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g) for n in SEQ_LENS]


def _split(flat: torch.Tensor) -> list[torch.Tensor]:
    return list(flat.split(SEQ_LENS))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tp1_matches_transformers(checkpoints, variant):
    path, hf = checkpoints[variant]
    seqs = _batch(hf.config.vocab_size)
    model = load_model(ModelConfig(path=path, dtype="float32"), ParallelState.single())
    with torch.no_grad():
        hidden = prefill(model, torch.cat(seqs), SEQ_LENS)
        logits = model.compute_logits(hidden)
    for ours, ref in zip(_split(logits), hf_logits(hf, seqs), strict=True):
        assert (ours - ref).abs().max().item() < TOL


def test_tp2_matches_transformers(checkpoints):
    names = list(VARIANTS)
    vocab = min(checkpoints[n][1].config.vocab_size for n in names)
    seqs = _batch(vocab, seed=2)
    per_rank = spawn_ranks(
        model_logits, 2, args=(2, [checkpoints[n][0] for n in names], [s.tolist() for s in seqs])
    )
    for i, name in enumerate(names):
        refs = hf_logits(checkpoints[name][1], seqs)
        for rank_logits in per_rank:  # every rank holds the gathered logits
            for ours, ref in zip(_split(rank_logits[i]), refs, strict=True):
                assert (ours - ref).abs().max().item() < TOL, name


def test_aux_hidden_states_are_transformers_hidden_states(checkpoints):
    path, hf = checkpoints["gqa_untied_odd_vocab"]
    seqs = _batch(hf.config.vocab_size, seed=3)
    model = load_model(ModelConfig(path=path, dtype="float32"), ParallelState.single())
    layers = (2, 0, 1)
    with torch.no_grad():
        _, aux = prefill(model, torch.cat(seqs), SEQ_LENS, layers)
        for i, seq in enumerate(seqs):
            ref = hf(seq[None], output_hidden_states=True).hidden_states
            for layer, ours in zip(layers, aux, strict=True):
                torch.testing.assert_close(_split(ours)[i], ref[layer][0], atol=TOL, rtol=0)


def test_incremental_decode_with_cache_matches_full_forward(checkpoints):
    """Prefill in chunks, then decode token by token through the KV cache: same logits."""
    path, hf = checkpoints["llama3_rope"]
    cfg = hf.config
    model = load_model(ModelConfig(path=path, dtype="float32"), ParallelState.single())
    seqs = _batch(cfg.vocab_size, seed=4)[1:3]  # lengths 7 and 19
    cache = ContiguousKVCache(
        cfg.num_hidden_layers, [1, 0], 32, cfg.num_key_value_heads, 16, torch.float32
    )
    refs = hf_logits(hf, seqs)
    done = [0, 0]
    # New tokens per sequence per step: chunked prefill (one sequence idle in step 3), then decode.
    plan = [[3, 6], [1, 3], [0, 2], [1, 0]] + [[1, 1]] * 2 + [[0, 1]] * 6
    with torch.no_grad():
        for new in plan:
            starts = [0, new[0], new[0] + new[1]]
            ids = torch.cat([s[d : d + n] for s, d, n in zip(seqs, done, new, strict=True)])
            positions = torch.cat([torch.arange(d, d + n) for d, n in zip(done, new, strict=True)])
            seq_lens = [d + n for d, n in zip(done, new, strict=True)]
            meta = AttentionMetadata(starts, seq_lens, positions, cache)
            with attention_context(meta):
                logits = model.compute_logits(model(ids, positions))
            for i in range(2):
                got = logits[starts[i] : starts[i + 1]]
                want = refs[i][done[i] : done[i] + new[i]]
                assert got.shape == want.shape
                if new[i]:
                    assert (got - want).abs().max().item() < TOL
            done = seq_lens
    assert done == [len(s) for s in seqs]
