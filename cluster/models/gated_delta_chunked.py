"""The gated delta rule a chunk of tokens at a time, for long prefills.

Per head, with a_t = exp(g_t) and S the [dk, dv] state, token t does

    S_t = a_t S_{t-1} + k_t w_t^T,   w_t = beta_t (v_t - a_t S_{t-1}^T k_t),   o_t = S_t^T q_t

(`cluster.models.gated_delta` runs exactly this, token by token). Take a chunk of C tokens
starting from state S_0, and let G_i be the running sum of g over the chunk up to token i,
so that the decay from just after token j to token i is exp(G_i - G_j) (j <= i). Unrolling,

    S_i = exp(G_i) S_0 + sum_{j <= i} exp(G_i - G_j) k_j w_j^T.

Substituting a_i S_{i-1} (the same sum up to j < i) into w_i gives a C x C system that is
unit lower triangular:

    w_i + sum_{j < i} beta_i exp(G_i - G_j) (k_i . k_j) w_j = beta_i (v_i - exp(G_i) S_0^T k_i)

i.e. (I + A) W = diag(beta) V - diag(beta exp(G)) K S_0. With T = (I + A)^-1 (unit lower
triangular too; one triangular solve against the identity per chunk and head), W = U - P S_0
where U = T diag(beta) V and P = T diag(beta exp(G)) K depend on the chunk's own tokens
only, whatever state it starts from: they, and the rest below that does not involve S, are
computed for every chunk at once. Then, chunk after chunk,

    W   = U - P S_0
    O   = diag(exp(G)) Q S_0 + (Q K^T * D) W        (D_ij = exp(G_i - G_j), j <= i, else 0)
    S_C = exp(G_C) S_0 + (diag(exp(G_C - G)) K)^T W

Every exponent is of a sum of g <= 0, so no factor exceeds 1 (nothing is divided by a
decay). A token with beta = 0 and g = 0 leaves the state unchanged (w = 0, decay 1): the
padding of a grid of sequences of different lengths, and of the last chunk, is such tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def chunked_delta_rule(
    q: torch.Tensor,  # [num_seqs, T, heads, dk] float32, L2-normalised and scaled
    k: torch.Tensor,  # [num_seqs, T, heads, dk] float32, L2-normalised
    v: torch.Tensor,  # [num_seqs, T, heads, dv] float32
    g: torch.Tensor,  # [num_seqs, T, heads] float32 log decay (<= 0; 0 on padding)
    beta: torch.Tensor,  # [num_seqs, T, heads] float32 rate (0 on padding)
    s0: torch.Tensor,  # [num_seqs, heads, dk, dv] float32 starting states
    chunk: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """([num_seqs, T, heads, dv] outputs, [num_seqs, heads, dk, dv] final states) of the
    gated delta rule over T tokens, in chunks of at most `chunk` tokens (T split evenly)."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    n = -(-t // chunk)  # number of chunks
    c = -(-t // n)  # tokens per chunk: as even as possible, so the last pads the least
    pad = n * c - t
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    # one batch of m = n * b * h (chunk, sequence, head) triples, chunk-major, so that each
    # chunk's slice below is contiguous
    m = n * b * h
    q, k, v = (x.reshape(b, n, c, h, -1).transpose(0, 1).transpose(2, 3) for x in (q, k, v))
    q, k, v = (x.reshape(m, c, -1) for x in (q, k, v))  # [m, c, dk], [m, c, dk], [m, c, dv]
    g, beta = (x.reshape(b, n, c, h).permute(1, 0, 3, 2).reshape(m, c) for x in (g, beta))
    cum = g.cumsum(-1)  # [m, c]: G
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = (cum[:, :, None] - cum[:, None, :]).masked_fill_(~causal, float("-inf")).exp_()
    k_t = k.transpose(1, 2)  # [m, dk, c]
    system = torch.bmm(k, k_t).mul_(decay).mul_(beta[:, :, None])  # A below the diagonal
    attn = torch.bmm(q, k_t).mul_(decay)  # [m, c, c]: Q K^T * D
    eye = torch.eye(c, device=q.device).expand(m, c, c)
    inv = torch.linalg.solve_triangular(system, eye, upper=False, unitriangular=True)  # T
    inv.mul_(beta[:, None, :])  # T diag(beta)
    u = torch.bmm(inv, v)  # [m, c, dv]
    p = torch.bmm(inv.mul_(cum.exp()[:, None, :]), k)  # [m, c, dk]
    q_decayed = q * cum.exp()[:, :, None]  # [m, c, dk]
    k_to_end = (k * (cum[:, -1:] - cum).exp()[:, :, None]).transpose(1, 2)  # [m, dk, c]
    chunk_decay = cum[:, -1].exp()[:, None, None]  # [m, 1, 1]
    u, p, q_decayed, k_to_end, attn, chunk_decay = (
        x.view(n, b * h, *x.shape[1:]) for x in (u, p, q_decayed, k_to_end, attn, chunk_decay)
    )  # [n, b * h, ...]: chunk i's at [i]

    s = s0.reshape(b * h, dk, dv).to(torch.float32, copy=True)  # updated in place
    out = q.new_empty(n, b * h, c, dv)
    for i in range(n):
        w = torch.baddbmm(u[i], p[i], s, alpha=-1)  # [b * h, c, dv]: U - P S
        torch.bmm(q_decayed[i], s, out=out[i])
        out[i].baddbmm_(attn[i], w)
        s.mul_(chunk_decay[i]).baddbmm_(k_to_end[i], w)
    out = out.view(n, b, h, c, dv).permute(1, 0, 3, 2, 4).reshape(b, n * c, h, dv)[:, :t]
    return out, s.view(b, h, dk, dv)
