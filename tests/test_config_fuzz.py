"""Fuzzed broken configs: every one is refused with one line naming the problem, exit code 2, no traceback."""

import tomli_w
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fast.tools.cli import main

NUMERIC = {
    "run": [
        "seed",
        "workers",
        "epochs",
        "batch_size",
        "eval_every",
        "log_every",
        "deadline_s",
        "checkpoint_every",
        "max_bad_steps",
    ],
    "optimizer": ["lr", "momentum", "weight_decay"],
    "data": ["alpha"],
}
NEGATIVE_IS_WRONG = [
    ("run", "workers"),
    ("run", "epochs"),
    ("run", "batch_size"),
    ("optimizer", "lr"),
    ("run", "deadline_s"),
    ("data", "alpha"),
    ("optimizer", "momentum"),
]
CHOICES = [
    ("data", "name"),
    ("data", "partition"),
    ("model", "name"),
    ("optimizer", "name"),
    ("run", "device"),
    ("strategy", "name"),
]
IMPOSSIBLE = [
    {"run": {"workers": 4}, "strategy": {"name": "sync", "hierarchical": 3}},
    {"run": {"targets": [0.5, 2.0]}},
    {"strategy": {"name": "sync", "bucket_mb": -1}},
    {"strategy": {"name": "sync", "final_model": "worker:x"}},
]
BASE = {"run": {"workers": 2, "epochs": 1}, "data": {"name": "digits"}, "model": {"name": "mlp"}}

table_key = st.sampled_from([(t, k) for t, keys in NUMERIC.items() for k in keys])
mutations = st.one_of(
    st.tuples(
        st.just("unknown"),
        st.sampled_from(["run", "data", "model", "optimizer", "strategy"]),
        st.text("abcdefghijklmnopqrstuvwxyz_", min_size=3, max_size=12),
    ),
    st.tuples(st.just("wrong-type"), table_key, st.sampled_from(["many", "", "1e", "[1]", "true-ish"])),
    st.tuples(st.just("negative"), st.sampled_from(NEGATIVE_IS_WRONG), st.floats(-1e6, -1e-3)),
    st.tuples(st.just("choice"), st.sampled_from(CHOICES), st.text("xyz-0123456789", min_size=1, max_size=10)),
    st.tuples(st.just("impossible"), st.sampled_from(range(len(IMPOSSIBLE))), st.none()),
    st.tuples(
        st.just("toml"), st.sampled_from(["[run", "workers = = 2", "[run]\nworkers = '2\n", "x = [1,"]), st.none()
    ),
)


def _broken(mutation) -> str:
    kind, where, value = mutation
    config = {t: dict(v) for t, v in BASE.items()}
    if kind == "toml":
        return where
    if kind == "unknown":
        config.setdefault(where, {})[f"zz_{value}"] = 1
    elif kind == "wrong-type":
        config.setdefault(where[0], {})[where[1]] = value
    elif kind == "negative":
        config.setdefault(where[0], {})[where[1]] = value
    elif kind == "choice":
        config.setdefault(where[0], {})[where[1]] = f"no-such-{value}"
    else:
        for table, keys in IMPOSSIBLE[where].items():
            config.setdefault(table, {}).update(keys)
    return tomli_w.dumps(config)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations)
def test_every_broken_config_is_one_line_and_exit_code_2(tmp_path, capsys, mutation):
    path = tmp_path / "broken.toml"
    path.write_text(_broken(mutation))
    assert main(["train", str(path), "--out", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fast: error:"), captured.err
    assert "Traceback" not in captured.err + captured.out
