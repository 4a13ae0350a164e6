"""Growing draft trees (EAGLE-2), shared by the EAGLE-family and draft-model proposers.

After pass 0 each drafting request has the draft's logits after its root (the last token
the target verified) and, for EAGLE, a hidden state. Depth 1's candidates are the draft's
top-k tokens there. Each further depth feeds the nodes chosen to expand (dynamic trees:
the top-k candidates of the depth before by cumulative draft log-probability; static
trees: every node with children) in one forward for all requests, and takes each fed
node's top-k tokens (static: the ranks its children ask for) as candidates. The tree
verified is the `num_nodes` best candidates (static: all of them).

Fed nodes get KV slots after the root in the reserved region (sequence index root + 1 +
the order they were fed in) and their depth's position; they attend to the context, the
root and their fed ancestors (`tree_bits` from the root, `tree_starts`). Those slots only
ever hold this draft's scratch KV: the next step's pass 0 rewrites the verified positions.

Sampled drafts (`draft_sampling: sample`, temperature > 0): a node's children are drawn
from the draft distribution q without replacement (Gumbel top-k), in draw order, and the
tree keeps, at every node, a prefix of that order (a sibling's score is capped by the one
before it), as the verifier's rule assumes. Each request returns q at its root and at
every node for the verifier.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from cluster.config.speculative import SpeculativeConfig
from cluster.draft_tree import Candidate, DraftTree, select_tree
from cluster.models.attention import AttentionMetadata, KVCache, attention_context
from cluster.sample.randomness import draw_inv_exponentials
from cluster.sampling_params import SamplingParams

# forward(input_ids [m], hidden [m, H] | None, positions [m], step)
#   -> (logits [m, vocab], next hidden | None); run inside the pass's attention context.
StepFn = Callable[
    [torch.Tensor, torch.Tensor | None, torch.Tensor, int],
    tuple[torch.Tensor, torch.Tensor | None],
]


@dataclass(frozen=True)
class TreeShape:
    depth: int  # num_speculative_tokens
    topk: int
    num_nodes: int
    # A static tree: each node as the draft ranks along its path (e.g. (0, 1) = the second
    # best child of the best child of the root); None: EAGLE-2's dynamic tree.
    paths: tuple[tuple[int, ...], ...] | None = None

    def ranks_below(self, path: tuple[int, ...]) -> list[int]:
        """Static trees: the ranks of the children of the node at `path`."""
        assert self.paths is not None
        return sorted({p[-1] for p in self.paths if len(p) == len(path) + 1 and p[:-1] == path})

    @classmethod
    def of(cls, spec: SpeculativeConfig) -> TreeShape | None:
        """The tree `spec` drafts, or None for chains."""
        tree = spec.tree
        if tree is None:
            return None
        return cls(spec.num_speculative_tokens, tree.topk, tree.size, tree.paths)


@dataclass
class _Request:
    """One request's growing tree."""

    row: int  # in the drafting batch
    root_index: int  # sequence index (and position) of the root
    candidates: list[Candidate] = field(default_factory=list)
    paths: list[tuple[int, ...]] = field(default_factory=list)  # static rank path per candidate
    depth_of: list[int] = field(default_factory=list)
    fed_index: dict[int, int] = field(default_factory=dict)  # candidate -> order it was fed in
    hidden_out: dict[int, torch.Tensor] = field(default_factory=dict)  # fed candidate -> [H]
    dist: dict[int, torch.Tensor] = field(default_factory=dict)  # candidate (-1 root) -> q

    def ancestors(self, c: int) -> list[int]:
        nodes = []
        while c >= 0:
            nodes.append(c)
            c = self.candidates[c].parent
        return nodes


def _children(
    logits: torch.Tensor,  # [m, vocab]
    counts: list[int],  # [m] how many children each row gets
    params: list[SamplingParams],  # [m]
    sample: bool,
    generators: list[torch.Generator | None],  # [m]
) -> tuple[list[list[int]], list[list[float]], torch.Tensor | None]:
    """(tokens per row in draw / rank order, their log-probabilities, q rows or None)."""
    # scores: log-probabilities, at temperature T for rows that sample their drafts
    scores = torch.log_softmax(logits.float(), dim=-1)  # [m, vocab]
    keys = scores.clone()  # top-k of keys: by rank, or Gumbel-perturbed (draws in order)
    sampled_rows = [j for j, p in enumerate(params) if sample and not p.is_greedy]
    q = None
    if sampled_rows:
        temps = torch.tensor([max(p.temperature, 1e-6) for p in params], device=logits.device)
        q = torch.softmax(logits.float() / temps[:, None], dim=-1)
        rows = torch.tensor(sampled_rows, device=logits.device)
        # Gumbel noise log(1 / E), E ~ Exp(1), from each request's own generator
        inv_exp = draw_inv_exponentials(
            [j in sampled_rows for j in range(len(params))],
            {j: g for j, g in enumerate(generators) if g is not None},
            q.shape[1],
            q.device,
        )
        scores[rows] = q[rows].log()
        keys[rows] = scores[rows] + inv_exp[rows].log()
    order = keys.topk(max(max(counts, default=0), 1), dim=-1).indices  # [m, width]
    chosen = scores.gather(1, order).tolist()
    tokens = order.tolist()
    return (
        [t[:n] for t, n in zip(tokens, counts, strict=True)],
        [c[:n] for c, n in zip(chosen, counts, strict=True)],
        q,
    )


def grow_trees(
    step_fn: StepFn,
    root_logits: torch.Tensor,  # [n, vocab] after each drafting request's root
    root_hidden: torch.Tensor | None,  # [n, H] the hidden state depth 1 continues from
    root_indices: list[int],  # [n] sequence index (= position) of each root
    block_tables: torch.Tensor,  # [n, max_blocks]
    num_blocks: list[int],  # [n]
    block_size: int,
    kv_cache: KVCache,
    params: list[SamplingParams],  # [n]
    generators: Mapping[int, torch.Generator],  # row -> its request's draft generator
    sample: bool,
    shape: TreeShape,
) -> tuple[list[DraftTree], list[torch.Tensor | None]]:
    """A draft tree per request, and (sampled requests) q at its root and every node
    ([n_i + 1, vocab]; rows of nodes never expanded are zeros)."""
    device = root_logits.device
    n = root_logits.shape[0]
    gens = [generators.get(i) for i in range(n)]
    requests = [_Request(i, root_indices[i]) for i in range(n)]
    static = shape.paths is not None
    root_counts = [len(shape.ranks_below(())) if static else shape.topk for _ in range(n)]
    _add_children(requests, [-1] * n, root_logits, root_counts, params, sample, gens, shape)

    for depth in range(1, shape.depth):
        feeding: list[tuple[_Request, int]] = []  # (request, candidate) in feed order
        for r in requests:
            frontier = _frontier(r, depth, shape)
            room = num_blocks[r.row] * block_size - (r.root_index + 1 + len(r.fed_index))
            for c in frontier[: max(0, room)]:
                r.fed_index[c] = len(r.fed_index)
                feeding.append((r, c))
        if not feeding:
            break
        tokens = torch.tensor([r.candidates[c].token for r, c in feeding], device=device)
        hidden = None
        if root_hidden is not None:
            hidden = torch.stack(
                [
                    root_hidden[r.row]
                    if r.candidates[c].parent < 0
                    else r.hidden_out[r.candidates[c].parent]
                    for r, c in feeding
                ]
            )
        positions = torch.tensor([r.root_index + depth for r, _ in feeding], device=device)
        meta = _pass_metadata(feeding, positions, block_tables, block_size, kv_cache, device)
        with attention_context(meta):
            logits, next_hidden = step_fn(tokens, hidden, positions, depth)
        if next_hidden is not None:
            for j, (r, c) in enumerate(feeding):
                r.hidden_out[c] = next_hidden[j]
        counts = [len(shape.ranks_below(r.paths[c])) if static else shape.topk for r, c in feeding]
        rows = [r.row for r, _ in feeding]
        _add_children(
            [r for r, _ in feeding],
            [c for _, c in feeding],
            logits,
            counts,
            [params[i] for i in rows],
            sample,
            [gens[i] for i in rows],
            shape,
        )

    trees, probs = [], []
    for r in requests:
        limit = len(r.candidates) if static else shape.num_nodes
        tree, chosen = select_tree(r.candidates, limit)
        trees.append(tree)
        if r.dist:
            vocab = root_logits.shape[1]
            rows = torch.zeros(tree.num_nodes + 1, vocab, device=device)
            rows[0] = r.dist[-1]
            for node, c in enumerate(chosen):
                if c in r.dist:
                    rows[node + 1] = r.dist[c]
            probs.append(rows)
        else:
            probs.append(None)
    return trees, probs


def _frontier(r: _Request, depth: int, shape: TreeShape) -> list[int]:
    """The candidates at `depth` to feed: static trees, those with children; dynamic
    trees, the top-k by score."""
    at_depth = [c for c in range(len(r.candidates)) if r.depth_of[c] == depth]
    if shape.paths is not None:
        return [c for c in at_depth if shape.ranks_below(r.paths[c])]
    return sorted(at_depth, key=lambda c: (-r.candidates[c].score, c))[: shape.topk]


def _add_children(
    requests: list[_Request],
    parents: list[int],  # candidate expanded per row (-1: the root)
    logits: torch.Tensor,  # [m, vocab]
    counts: list[int],
    params: list[SamplingParams],
    sample: bool,
    generators: list[torch.Generator | None],
    shape: TreeShape,
) -> None:
    static = shape.paths is not None
    wanted = counts
    if static:  # a node's children are its draft's ranks 0..max asked for
        wanted = [
            (max(shape.ranks_below(r.paths[p] if p >= 0 else ())) + 1) if c else 0
            for r, p, c in zip(requests, parents, counts, strict=True)
        ]
    tokens, logps, q = _children(logits, wanted, params, sample, generators)
    for j, (r, parent) in enumerate(zip(requests, parents, strict=True)):
        if q is not None and sample and not params[j].is_greedy:
            r.dist[parent] = q[j]
        base = r.candidates[parent].score if parent >= 0 else 0.0
        parent_path = r.paths[parent] if parent >= 0 else ()
        depth = r.depth_of[parent] + 1 if parent >= 0 else 1
        ranks = shape.ranks_below(parent_path) if static else list(range(len(tokens[j])))
        cap = math.inf
        for rank in ranks:
            score = min(base + logps[j][rank], cap)
            cap = score  # siblings later in draw order never outrank earlier ones
            r.candidates.append(Candidate(parent, tokens[j][rank], score))
            r.paths.append((*parent_path, rank))
            r.depth_of.append(depth)


def _pass_metadata(
    feeding: list[tuple[_Request, int]],
    positions: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    kv_cache: KVCache,
    device: torch.device,
) -> AttentionMetadata:
    """One sequence per request (`feeding` holds each request's nodes together): its
    nodes fed in this pass are the new tokens (at sequence index root + 1 + feed order),
    attending to the context, the root and their fed ancestors."""
    starts, seq_lens, slots, bits, tree_starts, seqs = [0], [], [], [], [], []
    tables = block_tables.tolist()
    for r, node in feeding:
        if not seqs or seqs[-1] != r.row:  # the request's first node: a new sequence
            seqs.append(r.row)
            starts.append(starts[-1])
            seq_lens.append(0)
            tree_starts.append(r.root_index)
        index = r.root_index + 1 + r.fed_index[node]
        slots.append(tables[r.row][index // block_size] * block_size + index % block_size)
        mask = 1  # the root
        for a in r.ancestors(node):
            mask |= 1 << (1 + r.fed_index[a])
        bits.append(mask)
        starts[-1] += 1
        seq_lens[-1] = index + 1

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return AttentionMetadata(
        query_start_loc=starts,
        seq_lens=seq_lens,
        positions=positions,
        kv_cache=kv_cache,
        slot_mapping=ints(slots),
        block_tables=block_tables[seqs],
        tree_bits=ints(bits),
        tree_starts=tree_starts,
    )
