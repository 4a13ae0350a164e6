"""`DraftModelProposer`: a separate small LM (same tokenizer) with its own paged KV cache.

Its cache shares the target's block tables and slot mapping (same block size). Pass 0
runs the draft over every valid position of the step plus, for requests that sampled,
the newly sampled token; the last row gives draft 1, and passes 2..k feed each draft back
(`chain.run_chain`).
"""

from __future__ import annotations

import torch
from torch import nn

from cluster.models.attention import AttentionMetadata, KVCache, attention_context
from cluster.spec_decode.batch import DraftProposal, ProposalBatch
from cluster.spec_decode.chain import ModelDrafter
from cluster.spec_decode.tree_drafting import TreeShape


class DraftModelProposer(ModelDrafter):
    def __init__(
        self,
        model: nn.Module,
        kv_cache: KVCache,
        block_size: int,
        num_speculative_tokens: int,
        sample: bool,
        tree: TreeShape | None = None,
        min_confidence: float | None = None,
    ) -> None:
        super().__init__(kv_cache, block_size, num_speculative_tokens, sample, tree, min_confidence)
        self.model = model

    def warm_up(self) -> float:
        return 0.0  # the draft LM runs eagerly

    @torch.inference_mode()
    def propose(self, batch: ProposalBatch) -> DraftProposal:
        device = batch.input_ids.device
        target_ids = batch.input_ids.tolist()
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        block_size = self.block_size
        tables = batch.block_tables.tolist()
        for i, (start, valid) in enumerate(
            zip(batch.query_start_loc, batch.num_valid, strict=False)
        ):
            c = batch.num_computed[i]
            row_ids = target_ids[start : start + valid]
            if batch.sampled[i] and valid:
                row_ids.append(batch.next_token_ids[i])
            for p in range(c, c + len(row_ids)):
                positions.append(p)
                slots.append(tables[i][p // block_size] * block_size + p % block_size)
            ids.extend(row_ids)
            starts.append(starts[-1] + len(row_ids))
            seq_lens.append(c + len(row_ids))

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        meta = AttentionMetadata(
            starts,
            seq_lens,
            tensor(positions),
            self.kv_cache,
            slot_mapping=tensor(slots),
            block_tables=batch.block_tables,
        )
        with attention_context(meta):
            hidden = self.model(tensor(ids), meta.positions)
        k, drafting = self.drafting(batch)
        if not drafting:
            return DraftProposal.none(len(batch.sampled))
        last_rows = tensor([starts[i + 1] - 1 for i in drafting])

        def step_fn(tokens, hidden, positions, step):
            return self.model.compute_logits(self.model(tokens, positions)), None

        root_logits = self.model.compute_logits(hidden[last_rows])
        roots = [positions[starts[i + 1] - 1] for i in drafting]
        return self.draft_from_roots(step_fn, batch, drafting, k, root_logits, None, roots)
