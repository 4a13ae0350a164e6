"""A completion's logprobs as the replica sends them: per token, its own logprob and the
most likely tokens at its position (`TokenLogprob`)."""

from __future__ import annotations

from cluster.outputs import CompletionOutput, Logprob
from cluster.serve.protocol import TokenLogprob, TopLogprob


def token_logprobs(
    completion: CompletionOutput, start: int, num_top: int
) -> list[TokenLogprob] | None:
    """The logprobs of the output tokens from `start` on (None when not asked for)."""
    if completion.logprobs is None:
        return None
    return [
        token_logprob(token_id, entry, num_top)
        for token_id, entry in zip(
            completion.token_ids[start:], completion.logprobs[start:], strict=True
        )
    ]


def token_logprob(token_id: int, entry: dict[int, Logprob], num_top: int) -> TokenLogprob:
    """A token's own logprob, and the `num_top` most likely tokens at its position."""
    chosen = entry[token_id]
    ranked = sorted(
        (lp.rank, tid, lp)
        for tid, lp in entry.items()
        if lp.rank is not None and 1 <= lp.rank <= num_top
    )
    top = [
        TopLogprob(token_id=tid, token=lp.decoded_token or "", logprob=lp.logprob)
        for _, tid, lp in ranked
    ]
    return TokenLogprob(
        token_id=token_id, token=chosen.decoded_token or "", logprob=chosen.logprob, top=top
    )
