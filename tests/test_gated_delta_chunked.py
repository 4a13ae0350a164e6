"""The chunked gated delta rule (`cluster.models.gated_delta_chunked`) equals the token-by-token
recurrence, on its own and inside `gated_delta_ref` (which uses it for long runs of tokens
whose states are not kept), including the states kept in the recurrent state cache.

Everything is float32 and compared with atol = rtol = 1e-4.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cluster.models.gated_delta as gd
from cluster.engine.messages import ScheduledRequest
from cluster.models.attention import AttentionMetadata, attention_context
from cluster.models.gated_delta import RecurrentShape, _spans, gated_delta_ref
from cluster.models.gated_delta_chunked import chunked_delta_rule
from cluster.worker.state_cache import RecurrentStateCache

TOL = dict(atol=1e-4, rtol=1e-4)


def _token_loop(q, k, v, g, beta, s):
    """One sequence token by token, straight from the recurrence: q, k [T, heads, dk],
    v [T, heads, dv], g, beta [T, heads], s [heads, dk, dv]."""
    outs = []
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        w = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], s))
        s = s + k[t][:, :, None] * w[:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q[t], s))
    return torch.stack(outs) if outs else v.new_zeros(0, *v.shape[1:]), s


@pytest.mark.parametrize(
    "lens, chunk, decay_scale",
    [([1, 5, 37, 64], 16, 1.0), ([3, 130], 64, 4.0), ([100], 32, 0.1), ([9, 2], 64, 1.0)],
)
def test_chunked_equals_token_loop(lens, chunk, decay_scale):
    gen = torch.Generator().manual_seed(sum(lens) + chunk)
    heads, dk, dv, n, t = 3, 16, 8, len(lens), max(lens)
    q = F.normalize(torch.randn(n, t, heads, dk, generator=gen), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(n, t, heads, dk, generator=gen), dim=-1)
    v = torch.randn(n, t, heads, dv, generator=gen)
    g = -torch.rand(n, t, heads, generator=gen) * decay_scale
    beta = torch.rand(n, t, heads, generator=gen)
    s0 = torch.randn(n, heads, dk, dv, generator=gen)
    # padding (past each sequence's length): garbage q, k, v; g = beta = 0
    valid = (torch.arange(t)[None, :] < torch.tensor(lens)[:, None])[..., None]
    out, s = chunked_delta_rule(q, k, v, g * valid, beta * valid, s0, chunk)
    assert out.shape == (n, t, heads, dv) and s.shape == s0.shape
    for i, m in enumerate(lens):
        ref_out, ref_s = _token_loop(q[i, :m], k[i, :m], v[i, :m], g[i, :m], beta[i, :m], s0[i])
        torch.testing.assert_close(out[i, :m], ref_out, **TOL)
        torch.testing.assert_close(s[i], ref_s, **TOL)


def test_spans():
    assert _spans([False] * 70, 64) == [(0, 70, True)]
    assert _spans([False] * 70, None) == [(0, 70, False)]
    assert _spans([False] * 5 + [True] * 3, 64) == [(0, 8, False)]  # too short to chunk
    kept = [False] * 20 + [True] * 2 + [False] * 30 + [True]
    assert _spans(kept, 64) == [(0, 20, True), (20, 22, False), (22, 52, True), (52, 53, False)]


def _inputs(n, conv_dim, heads, gen):
    """(mixed_qkv [n, conv_dim], g [n, heads], beta [n, heads]) of one sequence."""
    mixed = torch.randn(n, conv_dim, generator=gen)
    g = -torch.rand(n, heads, generator=gen)
    beta = torch.rand(n, heads, generator=gen)
    return mixed, g, beta


def test_gated_delta_ref_chunked_equals_per_token(monkeypatch):
    """Sequences of different lengths (GQA: 2 key heads for 4 value heads) through two
    steps with a snapshot cache: the second step starts from the kept (nonzero) states and
    keeps states inside the grid (the shorter sequences' tails) and at its end. Outputs,
    and every kept state, equal the per-token path's."""
    nk, dk, heads, dv, kernel = 2, 16, 4, 8, 4
    gen = torch.Generator().manual_seed(7)
    conv_dim = 2 * nk * dk + heads * dv
    weight = torch.randn(conv_dim, kernel, generator=gen) * 0.5
    shape = RecurrentShape(conv_dim, kernel, heads, dk, dv)
    steps = [[30, 1, 50], [45, 19, 1]]  # tokens per request and step
    seqs = [_inputs(sum(s[i] for s in steps), conv_dim, heads, gen) for i in range(3)]
    calls = []  # tokens per call of the chunked form

    def counted(*args):
        calls.append(args[0].shape[1])
        return chunked_delta_rule(*args)

    monkeypatch.setattr(gd, "chunked_delta_rule", counted)

    results = {}
    for chunk_size in (None, 16):
        cache = RecurrentStateCache({0: shape}, num_slots=3, num_snapshots=3, dtype=torch.float32)
        outs, done = [], [0, 0, 0]
        for lens in steps:
            for i in range(3):
                if f"r{i}" not in cache.slot_of:
                    cache.add(f"r{i}")
            items = [
                ScheduledRequest(f"r{i}", list(range(n)), done[i], 0, [], False)
                for i, n in enumerate(lens)
            ]
            step = cache.begin_step(items)
            meta = AttentionMetadata.for_prefill(lens)
            meta.recurrent = step
            rows = [slice(done[i], done[i] + n) for i, n in enumerate(lens)]
            args = [torch.cat([x[j][r] for x, r in zip(seqs, rows, strict=True)]) for j in range(3)]
            with attention_context(meta):
                outs.append(gated_delta_ref(*args, weight, 0, nk, dk, dv, chunk_size=chunk_size))
            cache.end_step(step)
            done = [d + n for d, n in zip(done, lens, strict=True)]
        results[chunk_size] = (outs, cache)
    # the chunked form ran over the runs of at least 16 columns with nothing kept: [1, 27)
    # and [30, 47) in step 1 (the 30-token sequence keeps the states after columns 27..29,
    # the 1-token one after column 0), [19, 42) in step 2 ([1, 16) is too short)
    assert calls == [26, 17, 23]

    (ref_outs, ref_cache), (outs, cache) = results[None], results[16]
    for ours, ref in zip(outs, ref_outs, strict=True):
        torch.testing.assert_close(ours, ref, **TOL)
    for name in ("recurrent", "conv"):
        ours, ref = getattr(cache, name)[0], getattr(ref_cache, name)[0]
        torch.testing.assert_close(ours, ref, **TOL)
        assert ref.abs().sum() > 0
