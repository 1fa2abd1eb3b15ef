"""What one more row of a step costs, measured while serving (speculative decoding's adaptive rule).

A decode-only step of R rows (a row per sequence, plus its drafts) takes about a + b R: the
weights are read once a step (a), every row adds its compute and attention (b). A draft pays
when the tokens it is expected to add cost less than the step makes anyway, which needs the
cost of one more row in units of a one-row step: c = b / (a + b). It depends on the model (its
output layer, its width), the machine and the context length, so the engine times its steps
and fits a and b by weighted least squares over the mean time of each row count seen recently
(an EWMA per count, so that a growing context moves the fit). The fit is blended with a prior
`ROW_COST_PRIOR`, weighted as `PRIOR_WEIGHT` steps, until enough steps of several row counts
came in: a draft that does not pay costs more than one that pays gains, so the prior sits near
the top of what was measured before the fit existed.
"""

from __future__ import annotations

ROW_COST_PRIOR = 0.45  # SmolLM2-135M's rows through the prefill-chunk path (0.35-0.55)
PRIOR_WEIGHT = 16.0  # the prior counts as this many steps
_MEAN_WEIGHT = 0.1  # of the newest step in its row count's mean time
_MAX_WEIGHT = 64  # a row count's steps count up to this many in the fit
_MIN_STEPS = 4  # a row count enters the fit after this many steps
_BOUNDS = (0.02, 1.0)  # what the fit may say: a row is neither free nor dearer than a step


class RowCost:
    """The cost of one more row of a decode step, in one-row steps: the prior, then the fit."""

    def __init__(self, prior: float = ROW_COST_PRIOR, prior_weight: float = PRIOR_WEIGHT) -> None:
        self.prior = prior
        self.prior_weight = prior_weight
        self._means: dict[int, float] = {}  # row count -> EWMA of its steps' seconds
        self._counts: dict[int, int] = {}
        self.value = prior

    def observe(self, rows: int, seconds: float) -> None:
        """Count one decode-only step of `rows` rows that took `seconds`."""
        if rows < 1 or seconds <= 0.0:
            return
        count = self._counts.get(rows, 0)
        mean = self._means.get(rows, seconds)
        weight = max(_MEAN_WEIGHT, 1.0 / (count + 1))  # a plain mean over the first steps
        self._means[rows] = mean + weight * (seconds - mean)
        self._counts[rows] = count + 1
        self.value = self._estimate()

    def _estimate(self) -> float:
        points = [
            (rows, mean, min(self._counts[rows], _MAX_WEIGHT))
            for rows, mean in self._means.items()
            if self._counts[rows] >= _MIN_STEPS
        ]
        fit = _fit(points)
        if fit is None:
            return self.prior
        value, weight = fit
        return (self.prior * self.prior_weight + value * weight) / (self.prior_weight + weight)


def _fit(points: list[tuple[int, float, int]]) -> tuple[float, float] | None:
    """(c, the weight of the steps it rests on) from (rows, mean seconds, weight) points, or
    None while they span a single row count."""
    if len({rows for rows, _, _ in points}) < 2:
        return None
    total = sum(w for _, _, w in points)
    mean_x = sum(w * x for x, _, w in points) / total
    mean_y = sum(w * y for _, y, w in points) / total
    sxx = sum(w * (x - mean_x) ** 2 for x, _, w in points)
    sxy = sum(w * (x - mean_x) * (y - mean_y) for x, y, w in points)
    slope = sxy / sxx
    one_row = mean_y + slope * (1 - mean_x)  # a + b
    if one_row <= 0.0:
        return _BOUNDS[1], total
    low, high = _BOUNDS
    return min(high, max(low, slope / one_row)), total
