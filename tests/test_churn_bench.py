"""bench/churn.py's figures from a run's membership events, on synthetic events (no processes): the member-seconds
present, each churn failure's recovery seconds and the time of joiners that never held the state."""

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "churn.py"


@pytest.fixture(scope="module")
def churn_bench():
    spec = importlib.util.spec_from_file_location("churn_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EVENTS = [
    {"generation": 0, "unix_time": 100.0, "members": [0, 1, 2], "joined": [], "left": []},
    # member 2 told to leave at 110.0, the survivors re-formed and healed at 112.5
    {"generation": 1, "unix_time": 112.5, "members": [0, 1], "joined": [],
     "left": [{"member": 2, "how": "killed", "evicted_unix_time": 110.0}]},
    {"generation": 2, "unix_time": 120.0, "members": [0, 1, 3], "joined": [3], "left": []},
    # two in one generation: one churn's (told at 125.0), one that went on its own (no order, no figure)
    {"generation": 4, "unix_time": 131.0, "members": [3], "joined": [],
     "left": [{"member": 0, "how": "killed", "evicted_unix_time": 125.0}, {"member": 1, "how": "silent for 11s"}]},
]  # fmt: skip


def test_recovery_seconds_run_from_the_order_to_leave_to_the_generation_without_the_member(churn_bench):
    assert churn_bench.recovery_seconds(EVENTS) == pytest.approx([2.5, 6.0])
    assert churn_bench.recovery_seconds(EVENTS[:1]) == [] and churn_bench.recovery_seconds([]) == []


def test_median_and_max_of_a_runs_recoveries(churn_bench):
    assert churn_bench.median_and_max([2.5, 6.0, 1.0]) == "2.5/6.0 (3)"
    assert churn_bench.median_and_max([]) == "-"


def test_member_seconds_count_each_generation_to_the_next(churn_bench):
    # 3 members for 12.5 s, 2 for 7.5 s, 3 for 11 s, then 1 to the end of training (40 s after the start)
    assert churn_bench.member_seconds(EVENTS, 40.0) == pytest.approx(3 * 12.5 + 2 * 7.5 + 3 * 11 + 1 * 9)


def test_joiners_that_never_held_the_state_count_their_time_present(churn_bench, tmp_path):
    # joiner 3 (at 120.0) never wrote a `healed` record, to the end of training (140.0); joiner 4 (at 125.0) did
    events = [*EVENTS[:3], {"generation": 3, "unix_time": 125.0, "members": [0, 1, 3, 4], "joined": [4], "left": []}]
    (tmp_path / "workers").mkdir()
    (tmp_path / "workers" / "metrics-4.jsonl").write_text('{"worker": 4, "kind": "healed", "sat_out_s": 2.0}\n')
    assert churn_bench.never_healed(tmp_path, events, 40.0) == pytest.approx(20.0)
    (tmp_path / "workers" / "metrics-3.jsonl").write_text('{"worker": 3, "kind": "healed", "sat_out_s": 1.0}\n')
    assert churn_bench.never_healed(tmp_path, events, 40.0) == 0.0
