"""The row cost speculative decoding's adaptive rule uses (engine/row_cost.py), from fake step
timings: the prior until steps of two row counts came in, then a fit that the prior weighs less
as steps accumulate, following the machine when its steps change."""

from __future__ import annotations

import pytest

from axon.engine.row_cost import ROW_COST_PRIOR, RowCost
from axon.engine.speculation import Speculator, min_acceptance
from axon.speculative_config import parse


def _steps(cost: RowCost, rows: int, seconds: float, count: int) -> None:
    for _ in range(count):
        cost.observe(rows, seconds)


def test_the_prior_holds_until_two_row_counts_are_seen():
    cost = RowCost()
    assert cost.value == ROW_COST_PRIOR
    _steps(cost, 1, 0.010, 50)  # one row count: nothing to fit a slope to
    assert cost.value == ROW_COST_PRIOR
    _steps(cost, 5, 0.012, 3)  # too few steps of 5 rows yet
    assert cost.value == ROW_COST_PRIOR


def test_the_fit_finds_the_cost_of_a_row_and_outweighs_the_prior():
    cost = RowCost()
    # 10 ms a one-row step, 0.5 ms a row more: c = 0.05
    for _ in range(100):
        cost.observe(1, 0.010)
        cost.observe(5, 0.012)
    assert cost.value == pytest.approx((ROW_COST_PRIOR * 16 + 0.05 * 128) / (16 + 128))
    assert cost.value < 0.1
    many = RowCost()
    for rows in (4, 8, 12, 16):  # no one-row step: the line through them says it
        _steps(many, rows, 0.010 + 0.001 * (rows - 1), 64)
    assert many.value == pytest.approx((ROW_COST_PRIOR * 16 + 0.1 * 256) / (16 + 256))


def test_a_change_of_the_step_times_moves_the_fit():
    cost = RowCost()
    for _ in range(100):
        cost.observe(1, 0.010)
        cost.observe(3, 0.011)  # c = 0.05
    cheap = cost.value
    for _ in range(100):
        cost.observe(1, 0.010)
        cost.observe(3, 0.016)  # c = 0.3: the context grew, every row attends to more
    assert cost.value > cheap + 0.15


def test_the_fit_stays_within_bounds():
    cost = RowCost(prior_weight=0.0)
    _steps(cost, 1, 0.010, 8)
    _steps(cost, 2, 0.009, 8)  # noise: the bigger step ran faster
    assert cost.value == pytest.approx(0.02)
    cost = RowCost(prior_weight=0.0)
    _steps(cost, 1, 0.010, 8)
    _steps(cost, 2, 0.040, 8)
    assert cost.value == 1.0


def test_the_speculator_uses_the_measured_cost_unless_one_is_set():
    spec = parse({"method": "ngram", "num_speculative_tokens": 4})
    speculator = Speculator(spec, drafter=None, max_model_len=1000)
    assert speculator.row_cost == ROW_COST_PRIOR
    for _ in range(200):
        speculator.time_step(1, 0.010)
        speculator.time_step(5, 0.012)
    measured = speculator.row_cost
    assert measured < 0.1 and measured == speculator.row_costs.value
    assert min_acceptance(1, measured) < min_acceptance(1)  # drafts need less acceptance
    speculator.row_cost = 0.0  # pinned (tests: every draft pays)
    speculator.time_step(5, 0.050)
    assert speculator.row_cost == 0.0
