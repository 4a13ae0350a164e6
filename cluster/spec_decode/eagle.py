"""`EagleProposer`: drafts from an EAGLE, EAGLE-3 or MTP head fed the target's features.

Pass 0 runs over every position whose target state is valid this step (rejected drafts
are left out): the input ids are shifted left by one, so position p sees token p+1 and the
target's feature at p, and each request's last slot holds its `next_token_ids` entry
(the token just sampled). For `[a1 | b1 b2 | c1 c2 c3]` with new tokens a2, b3, c4 the
ids are `[a2 | b2 b3 | c2 c3 c4]`. The draft KV at those positions is (re)written from
target features. The last row of each sampling request gives draft 1; passes 2..k feed
the previous draft with the draft's own hidden state (`chain.run_chain`).
"""

from __future__ import annotations

import itertools

import torch

from cluster.models.attention import AttentionMetadata, KVCache, attention_context
from cluster.models.compiled import CompiledForward, CompileOptions
from cluster.models.draft_base import DraftModel
from cluster.spec_decode.batch import DraftProposal, ProposalBatch
from cluster.spec_decode.chain import ModelDrafter
from cluster.spec_decode.tree_drafting import TreeShape


def shifted_input_ids(batch: ProposalBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(token index of every valid position [m], its shifted input id [m])."""
    index: list[int] = []
    ids: list[int] = []
    target_ids = batch.input_ids.tolist()
    for i, (start, valid) in enumerate(zip(batch.query_start_loc, batch.num_valid, strict=False)):
        index.extend(range(start, start + valid))
        ids.extend(target_ids[start + 1 : start + valid])
        if valid:
            ids.append(batch.next_token_ids[i])
    device = batch.input_ids.device
    return torch.tensor(index, dtype=torch.int64, device=device), torch.tensor(
        ids, dtype=torch.int64, device=device
    )


class EagleProposer(ModelDrafter):
    def __init__(
        self,
        draft: DraftModel,
        kv_cache: KVCache,
        block_size: int,
        num_speculative_tokens: int,
        sample: bool,
        compile_options: CompileOptions | None = None,
        tree: TreeShape | None = None,
        min_confidence: float | None = None,
    ) -> None:
        super().__init__(kv_cache, block_size, num_speculative_tokens, sample, tree, min_confidence)
        self.draft = draft
        # request id -> (position, [layer j's output there for j < n - 1]): what the
        # next step's first row of a multi-layer head reads (`_write_later_layers`)
        self._carry: dict[str, tuple[int, list[torch.Tensor]]] = {}
        # The draft's forward per kind of pass (an MTP head with several layers uses layer
        # `step % n` at pass `step`), compiled per token-count bucket when asked.
        self.forwards = []
        for kind in range(draft.num_step_kinds):

            def forward(ids, positions, hidden, kind=kind):
                return self.draft(ids, hidden, positions, kind)

            if compile_options is not None:
                device = self.draft.state.device
                forward = CompiledForward(forward, compile_options, device, f"draft pass {kind}")
            self.forwards.append(forward)

    def _forward(
        self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.forwards[step % len(self.forwards)](ids, positions, hidden)

    def warm_up(self) -> float:
        """Compile the draft's buckets now; returns the seconds it took."""
        width = int(self.draft.config.hidden_size)
        dtype = self.kv_cache.dtype  # the activations' dtype (a head may hold int tensors)
        return sum(
            f.warm_up([width], dtype) for f in self.forwards if isinstance(f, CompiledForward)
        )

    @torch.inference_mode()
    def propose(self, batch: ProposalBatch) -> DraftProposal:
        assert batch.target_hidden is not None
        index, ids = shifted_input_ids(batch)
        starts = list(itertools.accumulate(batch.num_valid, initial=0))
        meta = AttentionMetadata(
            query_start_loc=starts,
            seq_lens=[c + v for c, v in zip(batch.num_computed, batch.num_valid, strict=True)],
            positions=batch.positions[index],
            kv_cache=self.kv_cache,
            slot_mapping=batch.slot_mapping[index],
            block_tables=batch.block_tables,
        )
        hidden = self.draft.combine_target_hidden(batch.target_hidden[index])  # [m, H]
        with attention_context(meta):
            logits_hidden, next_hidden = self._forward(ids, hidden, meta.positions, 0)
        if len(self.forwards) > 1:
            self._write_later_layers(batch, ids, starts, meta, next_hidden)

        k, drafting = self.drafting(batch)
        if not drafting:
            return DraftProposal.none(len(batch.sampled))
        last_rows = torch.tensor([starts[i + 1] - 1 for i in drafting], device=ids.device)

        def step_fn(tokens, hidden, positions, step):
            logits_hidden, next_hidden = self._forward(tokens, hidden, positions, step)
            return self.draft.compute_logits(logits_hidden, step), next_hidden

        root_logits = self.draft.compute_logits(logits_hidden[last_rows], 0)
        roots = [batch.num_computed[i] + batch.num_valid[i] - 1 for i in drafting]
        return self.draft_from_roots(
            step_fn, batch, drafting, k, root_logits, next_hidden[last_rows], roots
        )

    def _write_later_layers(
        self,
        batch: ProposalBatch,
        ids: torch.Tensor,  # [m] pass 0's shifted input ids
        starts: list[int],  # [batch + 1] each request's rows
        meta: AttentionMetadata,  # pass 0's
        outputs: torch.Tensor,  # [m, H] layer 0's outputs
    ) -> None:
        """A head with n > 1 layers (MTP) runs layer s % n at pass s, and layer j at
        position q reads the token after q and layer j - 1's output at q - 1 (DeepSeek's
        depth j + 1 module; at position 0, the output at 0). Write each later layer's KV
        at this step's valid positions from exactly those inputs: this step's rows, and
        for a request's first row the output its previous step kept (`_carry`). Drafts
        then read what a recompute would have written, as long as k <= n (with k > n,
        pass n's layer 0 reads positions after the last verified one that no pass
        wrote). The one exception: the first position after a prefix-cache hit, whose
        previous output nobody kept, reads its own position's output instead."""
        for req_id in batch.freed_req_ids:
            self._carry.pop(req_id, None)
        requests = [i for i in range(len(batch.req_ids)) if starts[i + 1] > starts[i]]
        firsts = torch.tensor([starts[i] for i in requests], device=ids.device)
        sources = torch.arange(ids.shape[0], device=ids.device) - 1  # row q reads row q - 1
        sources[firsts] = firsts  # ... but a request's first row reads itself or its carry
        per_layer = [outputs]
        for layer in range(1, len(self.forwards)):
            hidden = per_layer[-1][sources]
            for i in requests:
                carry = self._carry.get(batch.req_ids[i])
                if carry is not None and carry[0] == batch.num_computed[i] - 1:
                    hidden[starts[i]] = carry[1][layer - 1]
            with attention_context(meta):
                _, out = self._forward(ids, hidden, meta.positions, layer)
            per_layer.append(out)
        # Keep layers 0..n-2's outputs at each request's last valid row for its next step.
        for i in requests:
            last = starts[i + 1] - 1
            self._carry[batch.req_ids[i]] = (
                batch.num_computed[i] + batch.num_valid[i] - 1,
                [out[last].clone() for out in per_layer[:-1]],
            )
