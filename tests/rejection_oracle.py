"""The per-request rejection walk, one child at a time: the readable specification of
`cluster/kernels/rejection.py` (its glossary), against which the vectorised torch path
and the Triton kernel are tested (and timed by `benchmarks/rejection_sampler.py`)."""

from __future__ import annotations

import torch

from cluster.kernels.rejection import after_rejection, race, residual
from cluster.kernels.rejection_inputs import PLACEHOLDER_TOKEN_ID, RejectionInputs, RejectionOutput


def rejection_sample_loop(x: RejectionInputs) -> RejectionOutput:
    """The per-request walk, one child at a time: the readable specification."""
    out = torch.full((x.batch_size, x.max_depth + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64)
    accepted = torch.full((x.batch_size, x.max_depth), -1, dtype=torch.int64)
    cu = x.cu_num_draft_tokens.tolist()
    full_q = x.request_has_draft_probs().tolist()
    for i in range(x.batch_size):
        greedy, full = bool(x.is_greedy[i]), torch.tensor([full_q[i]])
        drafts = x.draft_token_ids[cu[i] : cu[i + 1]].tolist()
        parents = x.draft_parents[cu[i] : cu[i + 1]].tolist()
        node, path, residual_of = -1, [], None  # residual_of: the last rejected child
        p = q = None
        for j, (token, parent) in enumerate(zip(drafts, parents, strict=True)):
            if parent != node:
                continue
            row = int(x.target_row_starts[i]) + node + 1
            if p is None:  # first child tried at this node
                p = x.target_probs[row : row + 1]
                q = None if x.draft_probs is None else x.draft_probs[cu[i] + j : cu[i] + j + 1]
            elif not greedy:  # a sibling after a rejection
                p, q = after_rejection(p, q, full, torch.tensor([drafts[residual_of]]))
            if greedy:
                ok = token == int(p.argmax())
            else:
                q_x = float(q[0, token]) if q is not None and full_q[i] else 1.0
                ok = q_x > 0 and float(x.uniforms[cu[i] + j]) * q_x < float(p[0, token])
            if ok:
                path.append(j)
                node, p, q, residual_of = j, None, None, None
            else:
                residual_of = j
        row = int(x.target_row_starts[i]) + node + 1
        if residual_of is None and x.bonus_token_ids is not None:
            final = int(x.bonus_token_ids[i])
        elif greedy:
            final = int(x.target_probs[row].argmax())
        else:
            if p is None:
                p = x.target_probs[row : row + 1]
            r = p
            if residual_of is not None:
                r = residual(p, q, full, torch.tensor([drafts[residual_of]]))
            final = int(race(p, r, x.inv_exponentials[i : i + 1])[0])
        tokens = [drafts[n] for n in path] + [final]
        out[i, : len(tokens)] = torch.tensor(tokens)
        accepted[i, : len(path)] = torch.tensor(path, dtype=torch.int64)
    device = x.target_probs.device
    return RejectionOutput(out.to(device), accepted.to(device))
