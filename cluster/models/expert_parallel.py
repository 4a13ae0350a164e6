"""Expert parallelism: one stage's TP ranks hold whole experts (rank r the r-th
`num_experts / tp_size` of them) instead of a slice of every expert, and tokens travel to
their experts.

Within a stage every TP rank holds the same activations, so each rank dispatches only its
own share of the tokens (a contiguous 1/tp_size of them): each of its (token, expert)
pairs goes, by one all-to-all over torch.distributed, to the rank holding that expert
(with the expert's local id, by a second); every rank runs the fused experts over the rows
it received; a third all-to-all brings each result back to the rank that sent it, which
weights the pairs and sums each token's experts in the reference's order. A rank's output
is complete for its own tokens and zero elsewhere, so the block's usual all-reduce (the
TP partial sum) assembles the whole batch. Eager only: the row counts are data.
"""

from __future__ import annotations

import torch

from cluster.kernels.fp8_format import FP8Experts
from cluster.kernels.fused_moe import fused_moe
from cluster.parallel import ParallelState
from cluster.parallel.comm import all_to_all


def token_share(num_tokens: int, state: ParallelState) -> tuple[int, int]:
    """[start, end) of the tokens this TP rank dispatches."""
    per_rank = -(-num_tokens // state.tp_size)
    start = min(state.tp_rank * per_rank, num_tokens)
    return start, min(start + per_rank, num_tokens)


# Opaque to dynamo (data-dependent all-to-all sizes). `_disable_dynamo` is
# `torch.compiler.disable` that imports dynamo at the first call instead of at import:
# dynamo takes ~1 s to import, which the scheduler actor (no forward) never needs.
@torch._disable_dynamo
def expert_parallel_experts(
    x: torch.Tensor,  # [num_tokens, hidden], the same on every TP rank
    w13: torch.Tensor,  # [local_experts, 2 * inter, hidden]: this rank's whole experts
    w2: torch.Tensor,  # [local_experts, hidden, inter]
    top_ids: torch.Tensor,  # [num_tokens, top_k] global expert ids
    top_weights: torch.Tensor,  # [num_tokens, top_k]
    state: ParallelState,
    fp8: FP8Experts | None = None,  # this rank's experts' FP8 block scales
) -> torch.Tensor:
    """[num_tokens, hidden]: the routed experts' output for this rank's share of the
    tokens, zeros for the others' (summed over the TP group by the caller)."""
    local = w13.shape[0]
    top_k = top_ids.shape[1]
    start, end = token_share(x.shape[0], state)
    ids = top_ids[start:end].reshape(-1)  # [pairs] this rank's pairs, pair order
    owner = ids // local
    order = owner.argsort(stable=True)  # pairs grouped by the rank holding their expert
    send = torch.bincount(owner, minlength=state.tp_size)
    ones = [1] * state.tp_size
    recv = all_to_all(send, ones, ones, state)
    send_counts, recv_counts = send.tolist(), recv.tolist()
    rows = all_to_all(x[start:end][order // top_k], send_counts, recv_counts, state)
    local_ids = all_to_all(ids[order] - owner[order] * local, send_counts, recv_counts, state)
    unit = torch.ones(rows.shape[0], 1, dtype=x.dtype, device=x.device)
    y = fused_moe(rows, w13, w2, local_ids[:, None], unit, fp8)  # [received, hidden]
    back = all_to_all(y, recv_counts, send_counts, state)  # [pairs] in `order`
    by_pair = torch.empty_like(back).index_copy_(0, order, back)
    by_pair = by_pair * top_weights[start:end].reshape(-1, 1)
    out = torch.zeros_like(x)
    out[start:end] = by_pair.view(end - start, top_k, x.shape[1]).sum(dim=1)
    return out
