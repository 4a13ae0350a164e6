"""A proposer wrapper that makes steps accept a chosen number of drafts."""

from __future__ import annotations


class SteeredProposer:
    """Runs the real proposer (so the draft's KV evolves as in production) but hands the
    scheduler drafts that are the target's greedy continuation with a wrong token at a
    varying position, so steps accept 0..k drafts. Records the real drafts."""

    def __init__(self, inner, continuations, k, vocab):
        self.inner, self.continuations, self.k, self.vocab = inner, continuations, k, vocab
        self.needs_token_history = True
        self.calls = []

    def propose(self, batch):
        real = self.inner.propose(batch)
        steered = []
        for i, history in enumerate(batch.token_history):
            if not batch.sampled[i]:
                steered.append([])
                continue
            prompt = next(p for p in self.continuations if tuple(history[: len(p)]) == p)
            done = len(history) - len(prompt)
            right = self.continuations[prompt][done : done + self.k]
            wrong_at = len(self.calls) % (self.k + 1)
            steered.append(
                [t if j != wrong_at else (t + 1) % self.vocab for j, t in enumerate(right)]
            )
            self.calls.append((list(history), real.token_ids[i]))
        return type(real)(steered, [None] * len(steered))


class SteeredTreeProposer:
    """Like `SteeredProposer`, for draft trees: each step's tree holds the target's greedy
    continuation on a path that is not the first branch (a wrong sibling comes first at
    every depth), with one wrong token at a varying depth, so steps accept 0..k drafts
    along paths whose nodes are not the chain's slots (their KV must move). Records each
    (history, real tree tokens, real tree parents)."""

    def __init__(self, inner, continuations, k, vocab):
        self.inner, self.continuations, self.k, self.vocab = inner, continuations, k, vocab
        self.needs_token_history = True
        self.calls = []

    def propose(self, batch):
        real = self.inner.propose(batch)
        tokens, parents = [], []
        for i, history in enumerate(batch.token_history):
            if not batch.sampled[i]:
                tokens.append([])
                parents.append(None)
                continue
            prompt = next(p for p in self.continuations if tuple(history[: len(p)]) == p)
            done = len(history) - len(prompt)
            right = self.continuations[prompt][done : done + self.k]
            wrong_at = len(self.calls) % (self.k + 1)
            self.calls.append((list(history), real.token_ids[i], real.parents[i]))
            node_tokens, node_parents, parent = [], [], -1
            for depth, token in enumerate(right):
                if depth == wrong_at:
                    token = (token + 1) % self.vocab
                node_tokens += [(token + 2) % self.vocab, token]  # a wrong sibling first
                node_parents += [parent, parent]
                parent = len(node_tokens) - 1
            tokens.append(node_tokens)
            parents.append(node_parents)
        return type(real)(tokens, [None] * len(tokens), parents)
