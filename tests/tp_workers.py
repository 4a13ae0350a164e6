"""Functions run on every rank by `spawn_ranks` in the tensor-parallel tests.

They live in an importable module (not a test file) so spawned processes can unpickle them.
"""

from __future__ import annotations

import torch
from forward_helpers import prefill

from cluster.config import ModelConfig
from cluster.models.loader import load_model
from cluster.parallel import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    destroy_parallel_state,
    init_parallel_state,
)
from cluster.parallel.comm import all_gather, gather, recv, send


def model_logits(
    rank: int, init_method: str, tp: int, paths: list[str], seqs: list[list[int]]
) -> list[torch.Tensor]:
    """Logits of each checkpoint in `paths` for the flattened batch `seqs`, on this rank."""
    torch.set_num_threads(1)
    state = init_parallel_state(rank, tp, 1, init_method, "gloo")
    try:
        outs = []
        for path in paths:
            model = load_model(ModelConfig(path=path, dtype="float32"), state, show_progress=False)
            ids = torch.tensor([t for s in seqs for t in s])
            with torch.no_grad():
                outs.append(model.compute_logits(prefill(model, ids, [len(s) for s in seqs])))
            del model
        return outs
    finally:
        destroy_parallel_state(state)


def layer_outputs(
    rank: int, init_method: str, tp: int, full: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Run every parallel layer on its shard of the full weights in `full`."""
    torch.set_num_threads(1)
    state = init_parallel_state(rank, tp, 1, init_method, "gloo")
    try:
        x = full["x"]
        out: dict[str, torch.Tensor] = {}

        rep = ReplicatedLinear(16, 12, state, bias=True)
        rep.weight.weight_loader(rep.weight, full["w"])
        rep.bias.weight_loader(rep.bias, full["b"])
        out["replicated"] = rep(x)

        col = ColumnParallelLinear(16, 12, state, bias=True, gather_output=True)
        col.weight.weight_loader(col.weight, full["w"])
        col.bias.weight_loader(col.bias, full["b"])
        out["column"] = col(x)

        row = RowParallelLinear(12, 16, state, bias=True)
        row.weight.weight_loader(row.weight, full["w_row"])
        row.bias.weight_loader(row.bias, full["b_row"])
        shard = 12 // tp
        out["row"] = row(full["x_row"][:, rank * shard : (rank + 1) * shard])

        merged = MergedColumnParallelLinear(16, [8, 8], state)
        merged.weight.weight_loader(merged.weight, full["gate"], 0)
        merged.weight.weight_loader(merged.weight, full["up"], 1)
        gate_up = merged(x)  # [n, 2 * 8 / tp] local: gate part then up part
        half = gate_up.shape[-1] // 2
        out["gate"] = all_gather(gate_up[:, :half].contiguous(), state)
        out["up"] = all_gather(gate_up[:, half:].contiguous(), state)

        qkv = QKVParallelLinear(16, 2, 4, 1, state)  # 4 query heads, 1 KV head (replicated)
        for shard_id in "qkv":
            qkv.weight.weight_loader(qkv.weight, full[shard_id], shard_id)
        q, k, v = qkv(x).split([qkv.q_size, qkv.kv_size, qkv.kv_size], dim=-1)
        out["q"] = all_gather(q.contiguous(), state)
        out["k"], out["v"] = k, v

        emb = VocabParallelEmbedding(11, 16, state)
        emb.weight.weight_loader(emb.weight, full["emb"])
        out["embedding"] = emb(full["ids"])
        head = ParallelLMHead(11, 16, state)
        head.tie_to(emb)
        out["logits"] = head(x)

        gathered = gather(x * (rank + 1), state, dim=0, dst=0)
        out["gather"] = gathered if gathered is not None else torch.empty(0)
        if rank == 0:
            send(x, 1, state)
            out["recv"] = x
        elif rank == 1:
            out["recv"] = recv(tuple(x.shape), x.dtype, 0, state)
        return out
    finally:
        destroy_parallel_state(state)
