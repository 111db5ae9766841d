"""Logic inside benchmark scripts that decides what a table says: the digits benchmark's choice rules (they pick
the sampler each method is scored with) and the 8gaussians mode-count measurement."""

import importlib.util
import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name):
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return load("digits")


def test_rank_choice_takes_the_best_mean_rank_and_breaks_ties_by_w2(bench):
    # columns (W2, TV, -confidence), lower is better in each
    val = {1: (3.0, 0.10, -0.80), 2: (3.1, 0.09, -0.90), 3: (3.2, 0.11, -0.85)}
    assert bench.rank_choice(val) == 2  # ranks 1: 0+1+2, 2: 1+0+0, 3: 2+2+1
    tie = {3: (3.2, 0.11, -0.90), 2: (3.1, 0.10, -0.80), 1: (3.0, 0.12, -0.85)}  # every rank sum is 3
    assert bench.rank_choice(tie) == 1  # the lowest W2, wherever it sits in the dict


def test_split_candidates_leave_one_predictor_call_and_one_nsf_step(bench):
    assert bench.split_candidates(6) == [1, 2, 3, 4]
    assert all(k + 1 + 1 <= 13 for k in bench.split_candidates(13))


def test_wins_and_verdict_count_per_metric_direction(bench):
    pp = {"w2": 3.1, "tv": 0.06, "conf": 0.91}
    ot = {"w2": 3.2, "tv": 0.05, "conf": 0.90}
    assert bench.wins(pp, ot) == ["w2", "conf"]  # lower W2 and TV win, higher confidence wins
    per_seed = [{"scores": {"NSGF++": {6: pp}, "OT-CFM": {6: ot}, "OT-CFM warped": {6: pp}}}]
    lines = bench.verdict(per_seed, [6]).splitlines()
    assert "on 2 of 3 (w2, conf)" in lines[0] and "on 0 of 3 (none)" in lines[1]


def test_results_are_written_as_plain_json(bench):
    res = {"warp": {("OT-CFM", 6): 0.5}, "val": {6: {1: (3.0, 0.1, -0.9)}}}
    assert json.loads(json.dumps(bench.plain(res))) == {"warp": {"OT-CFM 6": 0.5}, "val": {"6": {"1": [3.0, 0.1, -0.9]}}}


def test_mode_count_samples_move_exactly_the_asked_points_and_cost_w2():
    import torch

    from sinkflow import config, data
    from sinkflow.ot import w2

    counts = load("w2_mode_counts")
    gen = torch.Generator().manual_seed(0)
    moved = counts.labels_with_moves(1024, 8, gen)
    assert int((moved != torch.arange(1024) % 8).sum()) == 8  # each moved point lands on another mode
    _, target = data.distributions(config.resolve("8gaussians"))
    test = target.test_set(1024, seed=2000)
    exact_x = counts.exact_sample(target, torch.arange(1024) % 8, torch.Generator().manual_seed(1))
    iid_x = counts.exact_sample(target, torch.randint(0, 8, (1024,), generator=gen), torch.Generator().manual_seed(1))
    assert counts.imbalance(target, exact_x) <= 4 < 20 < counts.imbalance(target, iid_x)  # nearest-centre counts
    assert w2(exact_x, test) < 0.2 < 0.4 < w2(iid_x, test)  # the floor (~0.14) vs multinomial mode counts (~0.7)
