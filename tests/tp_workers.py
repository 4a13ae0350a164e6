"""`spawn_ranks`, and the functions it runs on every rank in the tensor-parallel tests.

They live in an importable module (not a test file) so spawned processes can unpickle them.
"""

from __future__ import annotations

import io
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp
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
from cluster.parallel.spawn import free_port


def model_logits(
    rank: int, init_method: str, tp: int, paths: list[str], seqs: list[list[int]], ep: int = 1
) -> list[torch.Tensor]:
    """Logits of each checkpoint in `paths` for the flattened batch `seqs`, on this rank
    (`ep`: the expert-parallel size)."""
    torch.set_num_threads(1)
    state = init_parallel_state(rank, tp, 1, init_method, "gloo", expert_parallel_size=ep)
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


def _run_rank(
    fn: Callable[..., Any], rank: int, init_method: str, args: tuple, results: Any
) -> None:
    try:
        # Serialized to bytes: tensors sent through shared memory would vanish with this process.
        buffer = io.BytesIO()
        torch.save(fn(rank, init_method, *args), buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # report every failure to the parent, whatever it is
        results.put((rank, False, traceback.format_exc()))


def spawn_ranks(
    fn: Callable[..., Any], world_size: int, args: tuple = (), timeout_s: float = 600.0
) -> list[Any]:
    """Call `fn(rank, init_method, *args)` in `world_size` processes; return results by rank.

    `fn` must be importable (a module-level function). A failure on any rank raises
    `RuntimeError` carrying that rank's traceback.
    """
    ctx = mp.get_context("spawn")
    init_method = f"tcp://127.0.0.1:{free_port()}"
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_run_rank, args=(fn, rank, init_method, args, results), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, ok, value = results.get(timeout=timeout_s)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            outputs[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [outputs[r] for r in range(world_size)]
