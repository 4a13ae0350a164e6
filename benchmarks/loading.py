"""Checkpoint loading speed per tensor-parallel rank against the disk's own read speed.

Writes a random Llama-shaped bfloat16 checkpoint of about `--gib` GiB in `--shards`
safetensors files (with an index), then, with the files evicted from the page cache
before every measurement (`posix_fadvise(DONTNEED)`):
- the disk: every file read whole, sequentially (GB/s);
- each rank of each TP size: `load_model` for that rank alone (it asks only for its
  slices) — GB/s of the bytes it holds, and GB/s of what the disk delivered to it
  (`/proc/self/io`: page granularity and readahead make a row-parallel slice of a
  row-major tensor pull more than the slice), each over the disk's speed.
Medians over `--rounds`, the disk and the loads interleaved.

    python benchmarks/loading.py [--gib 2 --shards 4 --tp 1 2 --rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from cluster.config import ModelConfig
from cluster.models.loader import load_model
from cluster.parallel import ParallelState


def write_checkpoint(folder: str, gib: float, shards: int) -> list[str]:
    """A random Llama checkpoint of about `gib` GiB; returns its files."""
    hidden, inter, vocab = 2048, 8192, 32000
    per_layer = (4 * hidden * hidden // 2 + 3 * hidden * inter) * 2  # GQA 16/4 heads
    layers = max(1, int((gib * 2**30 - 2 * vocab * hidden * 2) // per_layer))
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=vocab,
        architectures=["LlamaForCausalLM"],
    )
    config.save_pretrained(folder)
    names: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        names |= {
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (hidden // 4, hidden),
            p + "self_attn.v_proj.weight": (hidden // 4, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    items = list(names.items())
    per_shard = -(-len(items) // shards)
    weight_map, files = {}, []
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = items[s * per_shard : (s + 1) * per_shard]
        save_file(
            {n: torch.randn(shape, dtype=torch.bfloat16) for n, shape in part},
            os.path.join(folder, file),
        )
        weight_map |= {n: file for n, _ in part}
        files.append(os.path.join(folder, file))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return files


def evict(files: list[str]) -> None:
    os.sync()
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def disk_read_gbs(files: list[str]) -> float:
    evict(files)
    total, start = 0, time.perf_counter()
    for file in files:
        with open(file, "rb", buffering=0) as f:
            while chunk := f.read(64 << 20):
                total += len(chunk)
    return total / (time.perf_counter() - start) / 1e9


def _disk_bytes_read() -> int:
    """Bytes this process has had fetched from storage (page-cache misses included)."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["read_bytes"])


def load_rank(folder: str, files: list[str], tp: int, rank: int) -> tuple[float, float, float]:
    """(GB this rank holds, GB/s of it, GB/s the disk delivered) for one rank's load from
    a cold page cache."""
    evict(files)
    state = ParallelState(rank, tp, 0, 1, None, torch.device("cpu"))
    before, start = _disk_bytes_read(), time.perf_counter()
    model = load_model(ModelConfig(path=folder, dtype="bfloat16"), state, show_progress=False)
    seconds = time.perf_counter() - start
    read = (_disk_bytes_read() - before) / 1e9
    held = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    return held, held / seconds, read / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--folder", help="where to write the checkpoint (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        files = write_checkpoint(folder, args.gib, args.shards)
        size = sum(os.path.getsize(f) for f in files) / 1e9
        disk: list[float] = []
        loads: dict[tuple[int, int], list[float]] = {}
        reads: dict[tuple[int, int], list[float]] = {}
        held: dict[tuple[int, int], float] = {}
        for _ in range(args.rounds):
            disk.append(disk_read_gbs(files))
            for tp in args.tp:
                for rank in range(tp):
                    held[tp, rank], gbs, read_gbs = load_rank(folder, files, tp, rank)
                    loads.setdefault((tp, rank), []).append(gbs)
                    reads.setdefault((tp, rank), []).append(read_gbs)
            disk.append(disk_read_gbs(files))
        disk_gbs = statistics.median(disk)
        print(f"checkpoint {size:.2f} GB in {args.shards} files; disk read {disk_gbs:.2f} GB/s\n")
        print("| TP | rank | GB held | GB held/s | / disk | GB/s read from disk | / disk |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for (tp, rank), values in loads.items():
            gbs, read = statistics.median(values), statistics.median(reads[tp, rank])
            print(
                f"| {tp} | {rank} | {held[tp, rank]:.2f} | {gbs:.2f} | {gbs / disk_gbs:.0%} | "
                f"{read:.2f} | {read / disk_gbs:.0%} |"
            )


if __name__ == "__main__":
    main()
