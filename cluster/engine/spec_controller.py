"""Adaptive speculation: how many drafts to propose next, chosen by measured goodput.

Whether speculation pays depends on the batch: at batch 1 a step's cost barely grows
with its token count, so drafts are nearly free; on a compute-bound device a large batch
pays for every draft position in full. The controller treats each draft count
k = 0..K as an arm, separately for each batch-size bucket (1, 2, 3-4, 5-8, ...), and
measures each arm's goodput: output tokens per second of engine step time, averaged
over windows of `window_steps` steps during which k is held.

- Buckets created before anything is measured (the first batch sizes seen) climb: they
  start at k = 0 (speculation off) and measure k + 1 while each arm beats the one below,
  then keep the best. The first steps therefore run no slower than speculation off but
  for at most one window of an arm past the peak (one window of k = 1 where drafting
  does not pay), instead of a sweep through every arm, the worst included.
- A bucket that has measured fewer than two arms follows the nearest bucket that has.
- Probes are local and back off: every `explore_every` windows a neighbour of the
  chosen k (k - 1 or k + 1, untried first) is measured for one window; while probes
  change nothing the interval doubles (up to `max_explore_every`), so a far-off bad
  arm is never paid for again and a settled bucket rarely pays for probes at all, yet a
  change in acceptance or load is still noticed (and climbed towards, one k at a time).
- Drafting must clearly pay: k > 0 is chosen only when its goodput beats k = 0's by
  `min_gain` (`min_gain_single` at batch 1). With several requests, drafts cost more
  than a step's goodput shows: requests accept at different rates, so a batch that
  starts together finishes unevenly and its last steps run nearly empty (measured on
  SmolLM2 at batch 16: +14% goodput per step, -10% end to end). A lone request has no
  such tail.

k = 0 turns drafting off (a draft with its own KV still reads the new tokens, so it is
ready when k rises again). Every k is lossless, so this only moves speed, never output.
Deterministic: no random exploration.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Bucket:
    goodput: list[float | None]  # per k: tokens / s, exponential moving average over windows
    current: int  # the arm being measured or used
    sweeping: bool  # climbing from k = 0 while goodput rises
    tokens: int = 0  # this window so far
    seconds: float = 0.0
    steps: int = 0
    windows: int = 0  # completed since the bucket was created
    next_probe: int = 0
    probing: bool = False  # the current window is a probe
    since_probe: int = 0  # windows since the last probe
    interval: int = 0  # windows between probes (0: not set yet)
    choice_before_probe: int = 0

    @property
    def untried(self) -> list[int]:
        return [k for k in range(len(self.goodput) - 1, -1, -1) if self.goodput[k] is None]


class SpecController:
    def __init__(
        self,
        max_drafts: int,
        window_steps: int = 4,
        explore_every: int = 8,
        smoothing: float = 0.5,
        min_gain: float = 0.25,
        min_gain_single: float = 0.02,
        max_explore_every: int = 64,
    ) -> None:
        self.max_drafts = max_drafts
        self.window_steps = window_steps
        self.explore_every = explore_every
        self.smoothing = smoothing
        self.min_gain = min_gain
        self.min_gain_single = min_gain_single
        self.max_explore_every = max_explore_every
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket_of(batch_size: int) -> int:
        """0 for batch 1, 1 for 2, 2 for 3-4, 3 for 5-8, ..."""
        return max(0, batch_size - 1).bit_length()

    def _bucket(self, batch_size: int) -> _Bucket:
        key = self.bucket_of(max(1, batch_size))
        if key not in self._buckets:
            # Until some bucket has measured an arm, a new bucket measures all of its own.
            known = any(g is not None for b in self._buckets.values() for g in b.goodput)
            bucket = _Bucket([None] * (self.max_drafts + 1), 0, sweeping=not known)
            self._buckets[key] = bucket
            if known:
                bucket.current = self._choice(key)
        return self._buckets[key]

    def _best(self, goodput: list[float | None], key: int) -> int:
        """The best measured arm; k > 0 only when it beats k = 0 by the margin."""
        margin = self.min_gain if key > 0 else self.min_gain_single
        measured = [k for k, g in enumerate(goodput) if g is not None]
        best = max(measured, key=lambda k: goodput[k])  # type: ignore[arg-type, return-value]
        off = goodput[0]
        if best > 0 and off is not None and goodput[best] < (1 + margin) * off:  # type: ignore[operator]
            return 0
        return best

    def _choice(self, key: int) -> int:
        """The arm to use outside probes: this bucket's best once it has measured two
        arms, else the nearest such bucket's, else its own best or current arm."""
        bucket = self._buckets[key]
        if len(bucket.goodput) - len(bucket.untried) >= 2:
            return self._best(bucket.goodput, key)
        informed = [k for k, b in self._buckets.items() if len(b.goodput) - len(b.untried) >= 2]
        if informed:
            nearest = min(informed, key=lambda k: (abs(k - key), k))
            return self._best(self._buckets[nearest].goodput, nearest)
        if len(bucket.untried) < len(bucket.goodput):
            return self._best(bucket.goodput, key)
        return bucket.current

    def num_drafts(self, batch_size: int) -> int:
        """Drafts to propose in the coming step for a batch of `batch_size` requests."""
        return self._bucket(batch_size).current

    def observe(self, batch_size: int, num_drafts: int, num_tokens: int, seconds: float) -> None:
        """A finished step: `num_tokens` output tokens in `seconds`, proposing
        `num_drafts` drafts per request."""
        bucket = self._bucket(batch_size)
        if num_drafts != bucket.current:
            return  # a step decided before the bucket moved on
        bucket.tokens += num_tokens
        bucket.seconds += seconds
        bucket.steps += 1
        if bucket.steps >= self.window_steps:
            self._end_window(self.bucket_of(max(1, batch_size)))

    def _end_window(self, key: int) -> None:
        bucket = self._buckets[key]
        measured = bucket.tokens / bucket.seconds if bucket.seconds > 0 else 0.0
        old = bucket.goodput[bucket.current]
        bucket.goodput[bucket.current] = (
            measured if old is None else self.smoothing * measured + (1 - self.smoothing) * old
        )
        bucket.tokens, bucket.seconds, bucket.steps = 0, 0.0, 0
        bucket.windows += 1
        if bucket.sweeping:
            k, goodput = bucket.current, bucket.goodput
            rising = k == 0 or goodput[k] > goodput[k - 1]  # type: ignore[operator]
            if rising and k < self.max_drafts:
                bucket.current = k + 1
                return
            bucket.sweeping = False
        choice = self._choice(key)
        if bucket.probing:  # a probe just ended: probe less often while nothing changes
            bucket.probing, bucket.since_probe = False, 0
            unchanged = choice == bucket.choice_before_probe
            bucket.interval = min(2 * bucket.interval, self.max_explore_every) if unchanged else 0
        else:
            bucket.since_probe += 1
        bucket.interval = bucket.interval or self.explore_every
        neighbours = [k for k in (choice - 1, choice + 1) if 0 <= k <= self.max_drafts]
        if bucket.since_probe >= bucket.interval and neighbours:
            untried = [k for k in neighbours if bucket.goodput[k] is None]
            options = untried or neighbours
            bucket.current = options[bucket.next_probe % len(options)]
            bucket.next_probe += 1
            bucket.probing, bucket.choice_before_probe = True, choice
        else:
            bucket.current = choice

    def summary(self) -> dict[str, dict[str, object]]:
        """Per batch-size bucket: measured goodput per k and the k in use (for metrics)."""
        out: dict[str, dict[str, object]] = {}
        for key, bucket in sorted(self._buckets.items()):
            low, high = (1, 1) if key == 0 else (2 ** (key - 1) + 1, 2**key)
            out[str(low) if low == high else f"{low}-{high}"] = {
                "num_drafts": bucket.current,
                "goodput_by_num_drafts": list(bucket.goodput),
                "windows": bucket.windows,
            }
        return out
