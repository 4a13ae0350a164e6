"""Draft trees: the drafts of one request as a tree rooted at its last sampled token.

Nodes are numbered 0..n-1 in the order the target verifies them; a node's parent comes
before it (`parents[i] < i`, -1 for the root's children), and siblings are listed in the
order verification tries them (the draft's preferred one first). Node i is computed at
position `root_position + depth(i)` in KV slot `root_slot + 1 + i`; it attends to the
context, the root and its ancestors (`ancestor_mask`).

A chain of k drafts is the tree whose node i has parent i - 1.

EAGLE-2's dynamic tree (`grow_tree`): depth 1 takes the draft's top-k tokens after the
root; each later depth expands the top-k nodes of the depth before (by cumulative draft
log-probability) by their own top-k tokens; the tree verified is the `num_nodes` best
nodes of all those candidates. A child's cumulative log-probability is at most its
parent's, so the best nodes always include their ancestors (ties go to the node made
first, which is the parent).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


def max_tree_nodes(topk: int, depth: int) -> int:
    """How many candidate nodes EAGLE-2's expansion makes: topk at depth 1, then topk ** 2
    per depth (topk nodes expanded by topk children each)."""
    return topk + (depth - 1) * topk * topk if depth > 0 else 0


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]  # [n] node i's token
    parents: tuple[int, ...]  # [n] parent node, -1 for the root's children

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError("a draft tree needs one parent per token")
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"node {i}'s parent {parent} must come before it (or be -1)")

    @staticmethod
    def chain(tokens: list[int]) -> DraftTree:
        return DraftTree(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """[n] 1 for the root's children."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return tuple(depths)

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    def children(self, node: int) -> list[int]:
        """Node `node`'s children in verification order (-1: the root's)."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node` (empty for the root, -1)."""
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]

    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, self.num_nodes - 1))

    def ancestor_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[n + 1, n + 1] bool: row r (0 the root, i + 1 node i) may attend to column c
        (same numbering) when c is r or one of its ancestors."""
        n = self.num_nodes
        mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        mask[:, 0] = True
        for i, parent in enumerate(self.parents):
            mask[i + 1] = mask[parent + 1]
            mask[i + 1, i + 1] = True
        return mask.to(device)


@dataclass(frozen=True)
class Candidate:
    """A node made while growing a tree: its parent candidate (-1: the root), token and
    cumulative draft log-probability."""

    parent: int
    token: int
    score: float


def select_tree(candidates: list[Candidate], num_nodes: int) -> tuple[DraftTree, list[int]]:
    """The `num_nodes` best candidates as a tree (parents first, siblings best first), and
    for each node the candidate it came from."""
    order = sorted(range(len(candidates)), key=lambda c: (-candidates[c].score, c))
    chosen = sorted(
        order[:num_nodes], key=lambda c: (_depth(candidates, c), -candidates[c].score, c)
    )
    node_of = {c: i for i, c in enumerate(chosen)}
    parents = []
    for c in chosen:
        parent = candidates[c].parent
        if parent >= 0 and parent not in node_of:
            raise ValueError("the best candidates must include their ancestors")
        parents.append(node_of[parent] if parent >= 0 else -1)
    return DraftTree(tuple(candidates[c].token for c in chosen), tuple(parents)), chosen


def _depth(candidates: list[Candidate], c: int) -> int:
    depth = 0
    while c >= 0:
        depth += 1
        c = candidates[c].parent
    return depth
