"""Held-out counts of a training step: top-1 hits per TTT step, labels outside the draft
vocabulary counted as misses, and the acceptance length of greedy chains."""

import torch

from cluster.train.loop import NO_LABEL, OUT_OF_VOCAB, StepCounts, collate, loss_labels


def test_chains_stop_at_their_first_miss_and_out_of_vocabulary_labels_are_misses():
    labels = [
        torch.tensor([[5, 6, OUT_OF_VOCAB, NO_LABEL]]),
        torch.tensor([[7, 8, 9, NO_LABEL]]),
        torch.tensor([[1, 2, NO_LABEL, NO_LABEL]]),
    ]
    predictions = [
        torch.tensor([[5, 6, 0, NO_LABEL]]),  # rows 0, 1 right; row 2's label is not drafted
        torch.tensor([[7, 0, 9, NO_LABEL]]),  # row 2 right here, but its chain ended at step 0
        torch.tensor([[1, 2, NO_LABEL, NO_LABEL]]),  # row 1 right, its chain ended at step 1
    ]
    counts = StepCounts.of(predictions, labels)
    assert counts.hits == [2, 2, 2]
    assert counts.totals == [3, 3, 2]
    assert counts.chain_hits == [2, 1, 1]
    assert counts.accuracy == [2 / 3, 2 / 3, 1.0]
    assert counts.acceptance_length == 1 + 4 / 3  # row 0: 3 + 1, row 1: 1 + 1, row 2: 0 + 1
    both = counts + counts
    assert both.chain_hits == [4, 2, 2] and both.acceptance_length == counts.acceptance_length


def test_collate_marks_tokens_outside_the_draft_vocabulary():
    sequence = {"token_ids": [3, 4, 5, 6, 7, 8], "answer_start": 2, "features": torch.zeros(6, 2)}
    label_map = torch.full((10,), OUT_OF_VOCAB)
    label_map[[4, 6, 8]] = torch.tensor([0, 1, 2])  # draft classes of the kept tokens
    batch = collate([sequence], [0], label_map, steps=1)
    # row p predicts token p + 2 from the second answer token on: rows 1..3 -> 6, 7, 8
    assert batch.labels[0].tolist() == [[NO_LABEL, 1, OUT_OF_VOCAB, 2, NO_LABEL, NO_LABEL]]
    assert loss_labels(batch.labels[0]).tolist() == [[NO_LABEL, 1, NO_LABEL, 2] + [NO_LABEL] * 2]
