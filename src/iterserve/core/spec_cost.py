"""Measured costs behind the adaptive K: seconds of a decode / verify step by its row
count, and the proposer's seconds per drafting request.

A step's time is not linear in its rows: the runner's fused few-row decoder takes at
most ``fused_rows`` rows; one row more falls onto the batched path, whose per-step
overhead is several times a fused step on a small model. So the table keeps one
average per row count and splits the row counts into regimes that never share a
line: one row (the lone-token path), ``2 .. fused_rows`` (the fused decoder) and
above. An unmeasured row count is interpolated between measured ones of its regime,
or extrapolated from the nearest with the regime's slope; with nothing measured in
its regime it is extrapolated from the nearest measured one, optimistically (below
it: in proportion to its rows), so the first such step gets tried and measured. With
nothing measured there is no prediction (the caller falls back to its linear model).

One sample can mislead: a step that met a page fault or a cache evicted by other work
costs several times its row count's usual. Until a row count has ``TRUST_SAMPLES``
samples, it is priced at no more than the line fitted (least squares, by samples)
through its regime's trusted row counts; where a regime has two of those, that line
also prices its unmeasured row counts. Otherwise one spike could price every larger
step out, and, never tried again, keep speculation off for good.

The engine feeds it (its clock, never read here): no clock in ``core/``.
"""

from __future__ import annotations

import bisect

# Weight of the newest sample in a row count's average.
EWMA_ALPHA = 0.2
# A sample more than this many times the current average is a hiccup (GC, a page
# fault): it counts as this many times.
OUTLIER = 2.0
# Slope, as a share of the mean seconds per row, assumed where a regime has one
# measured row count (or none): optimistic (a fused step streams every weight once for
# all its rows, so a row costs little), so that a larger step gets tried once and
# measured; the second measured row count gives the regime its real slope.
SLOPE_SHARE = 0.15
# Samples before a row count's own average is trusted alone (module docstring).
TRUST_SAMPLES = 3
# Most weight one row count has in its regime's fitted line.
FIT_WEIGHT_CAP = 10


class StepCostTable:
    """Seconds of steps without prefill tokens, by row count (module docstring)."""

    def __init__(self, fused_rows: int = 0) -> None:
        self.fused_rows = fused_rows
        self.seconds: dict[int, float] = {}
        self.samples: dict[int, int] = {}
        self._keys: list[int] = []  # the measured row counts, ascending
        self._fits: dict[int, tuple[float, float] | None] = {}  # regime -> (a, b), cached

    def regime(self, rows: int) -> int:
        if rows <= 1:
            return 0
        return 1 if rows <= self.fused_rows else 2

    def observe(self, rows: int, seconds: float) -> None:
        if rows <= 0 or seconds <= 0:
            return
        self._fits.clear()
        old = self.seconds.get(rows)
        if old is None:
            self.seconds[rows] = seconds
            self.samples[rows] = 1
            bisect.insort(self._keys, rows)
            return
        self.seconds[rows] = old + EWMA_ALPHA * (min(seconds, OUTLIER * old) - old)
        self.samples[rows] += 1

    def predict(self, rows: int) -> float | None:
        """Seconds of a step of ``rows`` rows, or None when nothing is measured."""
        sec = self.seconds
        got = sec.get(rows)
        if got is not None and self.samples[rows] >= TRUST_SAMPLES:
            return got
        fit = self._fit(self.regime(rows))
        if fit is not None:
            est = max(fit[0] + fit[1] * rows, 0.0)
            return est if got is None else min(got, est)
        if got is not None:
            return got
        keys = self._keys
        if not keys:
            return None
        reg = self.regime(rows)
        i = bisect.bisect_left(keys, rows)  # keys[i - 1] < rows < keys[i]
        lo = keys[i - 1] if i > 0 and self.regime(keys[i - 1]) == reg else -1
        hi = keys[i] if i < len(keys) and self.regime(keys[i]) == reg else -1
        if lo > 0 and hi > 0:
            return sec[lo] + (rows - lo) / (hi - lo) * (sec[hi] - sec[lo])
        if lo < 0 and hi < 0:
            # Nothing measured in this regime: from the nearest row count of another,
            # optimistically, so that the first such step gets tried and measured. Above
            # it, a small slope; below it (a regime under a cliff) its rows' share: the
            # small slope would price the cheaper regime nearly as the measured one, and
            # a plan that only ever lands above the cliff would never measure below it.
            near = keys[i - 1] if i == len(keys) or (
                i > 0 and rows - keys[i - 1] <= keys[i] - rows) else keys[i]
            if rows < near:
                return sec[near] * rows / near
            return sec[near] * (1.0 + SLOPE_SHARE * (rows - near) / near)
        # One side measured: the slope of its two nearest row counts, else assumed.
        near, j = (lo, i - 2) if lo > 0 else (hi, i + 1)
        other = keys[j] if 0 <= j < len(keys) and self.regime(keys[j]) == reg else -1
        if other > 0:
            slope = max((sec[other] - sec[near]) / (other - near), 0.0)
        else:
            slope = SLOPE_SHARE * sec[near] / near
        return max(sec[near] + slope * (rows - near), 0.0)


    def _fit(self, regime: int) -> tuple[float, float] | None:
        """(a, b) of seconds = a + b * rows through the regime's trusted row counts,
        weighted by their samples (capped); None with fewer than two of them."""
        if regime in self._fits:
            return self._fits[regime]
        pts = [(r, self.seconds[r], min(self.samples[r], FIT_WEIGHT_CAP)) for r in self._keys
               if self.samples[r] >= TRUST_SAMPLES and self.regime(r) == regime]
        fit = None
        if len(pts) >= 2:
            w = sum(p[2] for p in pts)
            mx = sum(p[0] * p[2] for p in pts) / w
            my = sum(p[1] * p[2] for p in pts) / w
            sxx = sum(p[2] * (p[0] - mx) ** 2 for p in pts)
            b = max(sum(p[2] * (p[0] - mx) * (p[1] - my) for p in pts) / sxx, 0.0)
            fit = (my - b * mx, b)
        self._fits[regime] = fit
        return fit


class DraftCost:
    """The proposer's seconds per request it drafts for (an average over calls).

    The first call is not counted: it builds the proposer's state (an n-gram index over
    the whole prompt, a draft model's first forward), dozens of times a later call. Were
    it the estimate, speculation could price itself off at once and, drafting no more,
    never measure the real cost (0 until then: optimistic, so the second call happens).
    Later requests' first calls are such spikes too: the outlier cap keeps them small."""

    def __init__(self) -> None:
        self.per_request = 0.0
        self.num_calls = 0

    def observe(self, num_requests: int, seconds: float) -> None:
        if num_requests <= 0 or seconds < 0:
            return
        x = seconds / num_requests
        self.num_calls += 1
        if self.num_calls == 1:
            return
        if self.num_calls == 2:
            self.per_request = x
        else:
            self.per_request += EWMA_ALPHA * (min(x, OUTLIER * self.per_request + 1e-6)
                                              - self.per_request)
