"""The target's answers, stored compactly enough to commit and carry between machines.

A store is a folder of parts, `part_00000.npz`, `part_00001.npz`, ..., each a compressed
numpy archive of one chunk of samples in prompt order:
- `token_ids`: uint16 (uint32 when the vocabulary needs it), every sample's prompt and
  answer ids end to end;
- `lengths`, `answer_starts`: int32 per sample;
- `keys`: uint64 per sample, a hash of the chat it answers, so a resumed run can check it
  continues the same prompt list.

A part is written to a temporary name and renamed, so an interrupted run leaves whole
parts only and resumes after the last one.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Sample:
    token_ids: list[int]  # prompt + answer
    answer_start: int  # index of the first answer token


def chat_key(chat: object) -> int:
    """A stable 64-bit key of a chat (any JSON-serialisable prompt)."""
    text = json.dumps(chat, sort_keys=True, ensure_ascii=False)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


class AnswerStore:
    """`meta` (e.g. the target and the answer length) is written beside the parts on the
    first append; a store made with other settings is refused. Without `meta` the store
    is opened for reading with whatever settings it was made with."""

    def __init__(self, directory: str, meta: dict | None = None) -> None:
        self.directory = directory
        meta_path = os.path.join(directory, "meta.json")
        stored = None
        if os.path.isfile(meta_path):
            with open(meta_path) as f:
                stored = json.load(f)
        self.meta = meta if meta is not None else (stored or {})
        if stored is not None and stored != self.meta:
            raise ValueError(
                f"answer store {directory} was made with {stored}, not {self.meta}; "
                "use another directory"
            )

    def _parts(self) -> list[str]:
        if not os.path.isdir(self.directory):
            return []
        names = sorted(n for n in os.listdir(self.directory) if n.startswith("part_"))
        return [os.path.join(self.directory, n) for n in names if n.endswith(".npz")]

    @property
    def num_parts(self) -> int:
        return len(self._parts())

    def keys(self) -> list[int]:
        keys: list[int] = []
        for path in self._parts():
            with np.load(path) as part:
                keys += part["keys"].tolist()
        return keys

    def read_part(self, index: int) -> list[Sample]:
        with np.load(self._parts()[index]) as part:
            lengths, answer_starts = part["lengths"], part["answer_starts"]
            tokens = part["token_ids"].astype(np.int64)
        ends = np.cumsum(lengths)
        return [
            Sample(tokens[end - n : end].tolist(), int(start))
            for n, end, start in zip(lengths, ends, answer_starts, strict=True)
        ]

    def read(self) -> list[Sample]:
        return [s for index in range(self.num_parts) for s in self.read_part(index)]

    def append(self, samples: list[Sample], keys: list[int]) -> str:
        """Write one more part; returns its path."""
        if len(samples) != len(keys):
            raise ValueError(f"{len(samples)} samples but {len(keys)} keys")
        os.makedirs(self.directory, exist_ok=True)
        with open(os.path.join(self.directory, "meta.json"), "w") as f:
            json.dump(self.meta, f, indent=2)
        path = os.path.join(self.directory, f"part_{len(self._parts()):05d}.npz")
        flat = [t for s in samples for t in s.token_ids]
        dtype = np.uint16 if max(flat, default=0) < 2**16 else np.uint32
        with open(path + ".tmp", "wb") as f:
            np.savez_compressed(
                f,
                token_ids=np.asarray(flat, dtype=dtype),
                lengths=np.asarray([len(s.token_ids) for s in samples], dtype=np.int32),
                answer_starts=np.asarray([s.answer_start for s in samples], dtype=np.int32),
                keys=np.asarray(keys, dtype=np.uint64),
            )
        os.replace(path + ".tmp", path)
        return path

    def check_prefix(self, keys: list[int]) -> int:
        """How many of `keys` (in order) are stored already; a ValueError when the store
        holds answers to other prompts (another prompt list or seed)."""
        stored = self.keys()
        mismatch = next(
            (i for i, (a, b) in enumerate(zip(stored, keys, strict=False)) if a != b), None
        )
        if mismatch is not None:
            raise ValueError(
                f"answer store {self.directory} does not match the prompts from prompt "
                f"{mismatch} on: it was made from another prompt list; use another directory"
            )
        return min(len(stored), len(keys))
