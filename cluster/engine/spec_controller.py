"""Adaptive speculation: how many drafts to propose next, chosen by measured goodput.

Whether speculation pays depends on the batch: at batch 1 a step's cost barely grows
with its token count, so drafts are nearly free; on a compute-bound device a large batch
pays for every draft position in full. The controller treats each draft count
k = 0..K as an arm, separately for each batch-size bucket (1, 2, 3-4, 5-8, ...), and
measures each arm's goodput: output tokens per second of engine step time, averaged
over windows of `window_steps` steps during which k is held. It tries every arm once,
then keeps the best, and re-tries one other arm (round-robin) every `explore_every`
windows, so a change in acceptance or load is noticed. k = 0 turns drafting off (the
draft still reads the new tokens, so it is ready when k rises again).

Every k is lossless, so this only moves speed, never output. Deterministic: no random
exploration, so a run with the same timings makes the same choices.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Arm:
    goodput: float | None = None  # tokens / s, exponential moving average over windows


@dataclass
class _Bucket:
    arms: list[_Arm]
    current: int  # the arm being measured or exploited
    tokens: int = 0  # this window so far
    seconds: float = 0.0
    steps: int = 0
    windows: int = 0  # completed since the bucket was created
    next_probe: int = 0  # round-robin over the other arms
    history: list[int] = field(default_factory=list)  # arm of every completed window


class SpecController:
    def __init__(
        self,
        max_drafts: int,
        window_steps: int = 4,
        explore_every: int = 8,
        smoothing: float = 0.5,
    ) -> None:
        self.max_drafts = max_drafts
        self.window_steps = window_steps
        self.explore_every = explore_every
        self.smoothing = smoothing
        self._buckets: dict[int, _Bucket] = {}
        self._last_bucket: int | None = None

    @staticmethod
    def bucket_of(batch_size: int) -> int:
        """0 for batch 1, 1 for 2, 2 for 3-4, 3 for 5-8, ..."""
        return max(0, batch_size - 1).bit_length()

    def _bucket(self, batch_size: int) -> _Bucket:
        key = self.bucket_of(batch_size)
        if key not in self._buckets:  # start by measuring the full draft count
            arms = [_Arm() for _ in range(self.max_drafts + 1)]
            self._buckets[key] = _Bucket(arms, current=self.max_drafts)
        self._last_bucket = key
        return self._buckets[key]

    def num_drafts(self, batch_size: int) -> int:
        """Drafts to propose in the coming step for a batch of `batch_size` requests."""
        return self._bucket(max(1, batch_size)).current

    def observe(self, batch_size: int, num_drafts: int, num_tokens: int, seconds: float) -> None:
        """A finished step: `num_tokens` output tokens in `seconds`, proposing
        `num_drafts` drafts per request."""
        bucket = self._bucket(max(1, batch_size))
        if num_drafts != bucket.current:
            return  # a step decided before the bucket moved on
        bucket.tokens += num_tokens
        bucket.seconds += seconds
        bucket.steps += 1
        if bucket.steps >= self.window_steps:
            self._end_window(bucket)

    def _end_window(self, bucket: _Bucket) -> None:
        arm = bucket.arms[bucket.current]
        measured = bucket.tokens / bucket.seconds if bucket.seconds > 0 else 0.0
        arm.goodput = (
            measured
            if arm.goodput is None
            else self.smoothing * measured + (1 - self.smoothing) * arm.goodput
        )
        bucket.history.append(bucket.current)
        bucket.tokens, bucket.seconds, bucket.steps = 0, 0.0, 0
        bucket.windows += 1
        untried = [k for k in range(len(bucket.arms) - 1, -1, -1) if bucket.arms[k].goodput is None]
        best = max(
            (k for k, a in enumerate(bucket.arms) if a.goodput is not None),
            key=lambda k: bucket.arms[k].goodput,
        )
        if untried:
            bucket.current = untried[0]
        elif bucket.windows % self.explore_every == 0 and len(bucket.arms) > 1:
            others = [k for k in range(len(bucket.arms)) if k != best]
            bucket.current = others[bucket.next_probe % len(others)]
            bucket.next_probe += 1
        else:
            bucket.current = best

    def summary(self) -> dict[str, dict[str, object]]:
        """Per batch-size bucket: measured goodput per k and the k in use (for metrics)."""
        out: dict[str, dict[str, object]] = {}
        for key, bucket in sorted(self._buckets.items()):
            low, high = (1, 1) if key == 0 else (2 ** (key - 1) + 1, 2**key)
            name = str(low) if low == high else f"{low}-{high}"
            out[name] = {
                "num_drafts": bucket.current,
                "goodput_by_num_drafts": [a.goodput for a in bucket.arms],
                "windows": bucket.windows,
            }
        return out
