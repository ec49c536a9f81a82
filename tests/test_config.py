"""Configuration: defaults, overrides, and one-line errors that name the key (exit code 2 from the CLI)."""

import subprocess
import sys

import pytest

from fast.assemble import load_config
from fast.errors import ConfigError
from fast.factories import load_factory
from fast.tools.cli import main


def test_defaults_are_the_documented_job():
    c = load_config()
    assert (c.run.workers, c.run.epochs, c.run.batch_size, c.data.name, c.model.name) == (
        4,
        3,
        64,
        "fashion-mnist",
        "lenet",
    )
    assert c.strategy.name == "sync" and c.run.targets == [0.80, 0.85]


def test_overrides_reach_any_key_and_parse_toml_values(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[run]\nworkers = 2\n[strategy]\nname = "sync"\nhierarchical = 2\n')
    c = load_config(path, run__epochs=0.5, **{"optimizer.lr": 0.1})
    assert c.run.workers == 2 and c.run.epochs == 0.5 and c.optimizer.lr == 0.1
    assert c.strategy.options() == {"hierarchical": 2}


def test_another_optimizer_drops_the_old_ones_own_arguments_and_keeps_the_rest(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[optimizer]\nname = "AdamW"\nlr = 0.002\nbetas = [0.9, 0.95]\nclip_norm = 1.0\n')
    c = load_config(path, optimizer__name="SGD", optimizer__dampening=0.1)
    assert c.optimizer.name == "SGD" and c.optimizer.lr == 0.002 and c.optimizer.clip_norm == 1.0
    assert not hasattr(c.optimizer, "betas") and c.optimizer.dampening == 0.1
    assert load_config(path, optimizer__name="adamw").optimizer.betas == [0.9, 0.95]  # the same one, other case


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"run__wrokers": 2}, "unknown key `run.wrokers`"),
        ({"run__workers": "four"}, "`run.workers`"),
        ({"run__workers": 0}, "`run.workers`"),
        ({"optimizer__lr": -1.0}, "`optimizer.lr`"),
        ({"data__name": "imagenet"}, "`data.name`"),
        ({"strategy__name": "nope"}, "`strategy.name` = 'nope' is not a strategy"),
        ({"strategy__bucket_mb": 0}, "`strategy.bucket_mb`"),
        ({"strategy__colour": 1}, "unknown key `strategy.colour`"),
        ({"run__workers": 4, "strategy__hierarchical": 3}, "`strategy.hierarchical` = 3 does not divide"),
        ({"run__targets": [1.5]}, "`run.targets`"),
    ],
)
def test_bad_values_give_one_line_errors_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, **overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_cli_exits_2_with_one_line_and_no_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\nworkers = 2\n")
    assert main(["train", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fast: error:") and "not valid TOML" in err and len(err.splitlines()) == 1
    assert main(["train", str(tmp_path / "missing.toml")]) == 2
    assert main(["train", "--set", "run.workers=0", str(bad)]) == 2
    good = tmp_path / "good.toml"
    good.write_text("[run]\nworkers = 2\n")
    assert main(["train", str(good), "--set", "run.workers=0"]) == 2
    assert "`run.workers`" in capsys.readouterr().err


def test_console_script_is_installed():
    out = subprocess.run([sys.executable, "-m", "fast.tools.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "train" in out.stdout


def test_options_set_with_a_new_strategy_name_stay_whatever_their_order():
    """A new strategy.name drops the old strategy's options, but not those given alongside it."""
    for overrides in (
        {"strategy__staleness": 3, "strategy__name": "ssp"},
        {"strategy__name": "ssp", "strategy__staleness": 3},
    ):
        config = load_config({"strategy": {"name": "local-sgd", "period": 4}}, **overrides)
        assert config.strategy.name == "ssp" and config.strategy.options() == {"staleness": 3}


def test_a_factory_its_module_lacks_is_one_line_naming_the_module_file_found(tmp_path, monkeypatch):
    """A module of the same name earlier on the path (a bench's `lm.py` before the example's) is the likely cause:
    the line names the file that was imported."""
    (tmp_path / "shadowing_module.py").write_text("def other():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "shadowing_module", raising=False)
    with pytest.raises(ConfigError) as error:
        load_factory("shadowing_module:wanted", "step.factory")
    message = str(error.value)
    assert f"shadowing_module ({tmp_path / 'shadowing_module.py'}) has no 'wanted'" in message and "\n" not in message
    monkeypatch.delitem(sys.modules, "shadowing_module", raising=False)
