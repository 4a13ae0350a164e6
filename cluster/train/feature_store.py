"""Cached target features on disk, one part per answer-store part, read through memory maps.

A feature folder holds, for part k of an answer store, `part_0000k.npy`: [total tokens,
width] in the dtype the target computed them in (bfloat16 is stored as its 16 raw bits,
numpy having no bfloat16; float32 is stored as float16), every sample's rows end to end (EAGLE-3: the three aux residual
streams side by side; EAGLE-1 / MTP: the final hidden state), and `part_0000k.npz`: the
part's `token_ids`, `lengths`, `answer_starts` and the rows' `dtype`, so a folder is
readable alone.
`load_shards` maps the arrays instead of reading them: a million-token cache (several
GB) costs page cache, not process memory, and batches copy only their own rows.
"""

from __future__ import annotations

import glob
import os
from typing import Any

import numpy as np
import torch

from cluster.train.answer_store import Sample


def part_stem(feature_dir: str, index: int) -> str:
    return os.path.join(feature_dir, f"part_{index:05d}")


def has_part(feature_dir: str, index: int, samples: list[Sample]) -> bool:
    """Whether part `index` exists; a ValueError if it holds other samples."""
    stem = part_stem(feature_dir, index)
    if not (os.path.isfile(stem + ".npy") and os.path.isfile(stem + ".npz")):
        return False
    with np.load(stem + ".npz") as part:
        lengths = part["lengths"].tolist()
        tokens = part["token_ids"]
    flat = [t for s in samples for t in s.token_ids]
    if lengths != [len(s.token_ids) for s in samples] or tokens.tolist() != flat:
        raise ValueError(f"{stem} holds other samples than its answer part; remove {feature_dir}")
    return True


def write_part(
    feature_dir: str, index: int, samples: list[Sample], rows: list[torch.Tensor]
) -> None:
    """Part `index`: `rows[i]` [len(samples[i].token_ids), width], bfloat16 kept as it is,
    any other float dtype as float16."""
    os.makedirs(feature_dir, exist_ok=True)
    stem = part_stem(feature_dir, index)
    joined = torch.cat([torch.as_tensor(r) for r in rows])
    if joined.dtype == torch.bfloat16:
        flat, dtype = joined.view(torch.int16).numpy(), "bfloat16"
    else:
        flat, dtype = joined.to(torch.float16).numpy(), "float16"
    with open(stem + ".npy.tmp", "wb") as f:
        np.save(f, flat)
    with open(stem + ".npz.tmp", "wb") as f:
        np.savez(
            f,
            token_ids=np.asarray([t for s in samples for t in s.token_ids], dtype=np.int64),
            lengths=np.asarray([len(s.token_ids) for s in samples], dtype=np.int64),
            answer_starts=np.asarray([s.answer_start for s in samples], dtype=np.int64),
            dtype=np.asarray(dtype),
        )
    os.replace(stem + ".npz.tmp", stem + ".npz")
    os.replace(stem + ".npy.tmp", stem + ".npy")  # last: its presence marks a whole part


def load_shards(feature_dirs: str | list[str]) -> list[dict[str, Any]]:
    """Every sequence of the folders, in order: {"token_ids", "answer_start", "features"
    ([len, width] bfloat16 or float16, a view of the memory-mapped part)}."""
    dirs = [feature_dirs] if isinstance(feature_dirs, str) else feature_dirs
    sequences = []
    for feature_dir in dirs:
        for path in sorted(glob.glob(os.path.join(feature_dir, "part_*.npy"))):
            features = torch.from_numpy(np.load(path, mmap_mode="c"))
            with np.load(path[:-4] + ".npz") as part:
                lengths, starts = part["lengths"].tolist(), part["answer_starts"].tolist()
                tokens = part["token_ids"].tolist()
                if "dtype" in part and str(part["dtype"]) == "bfloat16":
                    features = features.view(torch.bfloat16)
            offset = 0
            for length, start in zip(lengths, starts, strict=True):
                sequences.append(
                    {
                        "token_ids": tokens[offset : offset + length],
                        "answer_start": start,
                        "features": features[offset : offset + length],
                    }
                )
                offset += length
    return sequences
