"""`fast pack`: a job exported into one archive trains at a data owner's site without its source, reveals none of
it, and is refused, in one line, when altered, unsigned, truncated, too new or fed the wrong data."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

import fast
from fast.archive import read_package
from fast.errors import ConfigError, PackageError
from fast.jobs.models import build_model
from fast.tools.pack import load_trained, make_keys, names_path, pack

ROOT = Path(__file__).resolve().parents[1]
FAST = str(Path(sys.executable).with_name("fast"))
AUTHOR_CODE = '''
"""The author's secret model: nobody at the data owner's site may read this."""
import torch
import torch.nn.functional as F
from torch import nn


class ConfidentialNetwork(nn.Module):
    def __init__(self, input_shape, num_classes, hidden=48):
        super().__init__()
        self.proprietary_encoder = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.BatchNorm1d(hidden))
        self.secret_dropout = nn.Dropout(0.1)
        self.classifier_head = nn.Linear(hidden, num_classes)

    def forward(self, x):
        return self.classifier_head(self.secret_dropout(torch.relu(self.proprietary_encoder(x))))


def build_confidential_network(input_shape, num_classes, hidden=48):
    return ConfidentialNetwork(input_shape, num_classes, hidden)


def smoothed_secret_loss(model, x, y, smoothing=0.05):
    logits = model(x)
    return F.cross_entropy(logits, y, label_smoothing=smoothing)
'''
SECRETS = ["ConfidentialNetwork", "build_confidential_network", "smoothed_secret_loss", "proprietary_encoder",
           "secret_dropout", "classifier_head", "nobody at the data owner", "author_secret_module"]  # fmt: skip
JOB = {"run": {"workers": 2, "epochs": 3, "batch_size": 16, "eval_every": 0, "seed": 3},
       "data": {"name": "digits"},
       "model": {"factory": "author_secret_module:build_confidential_network", "hidden": 48},
       "step": {"factory": "author_secret_module:smoothed_secret_loss"}}  # fmt: skip


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """The author packs a job whose code lives in a temporary module, trains it from source for comparison, then
    the module is removed from disk and from sys.modules."""
    folder = tmp_path_factory.mktemp("author")
    (folder / "author_secret_module.py").write_text(AUTHOR_CODE)
    sys.path.insert(0, str(folder))
    try:
        make_keys(folder / "author")
        archive = pack(JOB, folder / "job.fastjob", sign=folder / "author.key", open_keys=("strategy.*", "run.epochs"))
        sources = {name: fast.train(JOB, out=str(folder / f"source-{name}"), strategy__name=name)
                   for name in ("sync", "gossip")}  # fmt: skip
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("author_secret_module", None)
        (folder / "author_secret_module.py").unlink()
    return folder, archive, sources


def _owner_trains(folder: Path, archive: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """The data owner's side: a fresh process, in a folder without the author's code."""
    command = [FAST, "train", str(archive), "--trust", str(folder / "author.pub"), "--out", str(out), *extra]
    return subprocess.run(command, capture_output=True, text=True, cwd=out.parent, timeout=300)


@pytest.mark.parametrize("strategy", ["sync", pytest.param("gossip", marks=pytest.mark.slow)])
def test_a_package_trains_without_its_source_as_the_source_did(packed, tmp_path, no_orphans, strategy):
    folder, archive, sources = packed
    owner = tmp_path / "owner"
    owner.mkdir()
    done = _owner_trains(folder, archive, owner / "run", "--set", "data.name=digits", "--set",
                         f"strategy.name={strategy}")  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads((owner / "run" / "summary.json").read_text())
    source = sources[strategy]
    assert abs(summary["final_test_accuracy"] - source["final_test_accuracy"]) <= 0.01
    if strategy == "sync":  # the same seed: the same initial weights, data order and operations
        mine = build_model("mlp", (1, 8, 8), 10)  # any module: only its state dict's names matter here
        trained = torch.load(owner / "run" / "model.pt", weights_only=True)
        names = json.loads(names_path(archive).read_text())["parameters_and_buffers"]
        assert len(trained) == len(names) and mine is not None
        reference = torch.load(folder / "source-sync" / "model.pt", weights_only=True)
        for key, value in trained.items():
            torch.testing.assert_close(value, reference[names[key.removeprefix("program.")]], rtol=0, atol=1e-6)


OWNER_LOOP = """
import torch
import fast
from fast.jobs.datasets import load_dataset

job = fast.init()
model, optimizer = job.prepare(*fast.packaged(job))
digits = load_dataset("digits", seed=0)
loader = job.loader(torch.utils.data.TensorDataset(digits.x_train, digits.y_train), batch_size=16)
for epoch in job.epochs(3):
    for x, y in loader:
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        job.log(loss=loss)
model.eval()
with torch.no_grad():
    _, accuracy = model(digits.x_test, digits.y_test)
job.finish(lambda _: {"accuracy": float(accuracy)})
"""


def test_the_data_owners_own_loop_trains_a_package_under_fast_run(packed, tmp_path, no_orphans):
    folder, archive, sources = packed
    (tmp_path / "owner_loop.py").write_text(OWNER_LOOP)
    command = [FAST, "run", "--config", str(archive), "--trust", str(folder / "author.pub"), "--out",
               str(tmp_path / "run"), str(tmp_path / "owner_loop.py")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final_test_accuracy"] > sources["sync"]["final_test_accuracy"] - 0.05


def test_the_trained_weights_load_back_into_the_authors_own_class(packed, tmp_path, no_orphans):
    folder, archive, _ = packed
    fast.train(str(archive), out=str(tmp_path / "run"), data__name="digits", run__epochs=1,
               package__trusted_key=str(folder / "author.pub"))  # fmt: skip
    sys.path.insert(0, str(tmp_path))
    (tmp_path / "author_copy.py").write_text(AUTHOR_CODE)
    try:
        from author_copy import ConfidentialNetwork

        model = load_trained(ConfidentialNetwork((1, 8, 8), 10), tmp_path / "run" / "model.pt", archive)
        trained = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
        names = {
            real: neutral
            for neutral, real in json.loads(names_path(archive).read_text())["parameters_and_buffers"].items()
        }
        assert torch.equal(model.classifier_head.bias, trained[f"program.{names['classifier_head.bias']}"])
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("author_copy", None)


def test_no_member_of_the_archive_reveals_the_source(packed):
    folder, archive, _ = packed
    with zipfile.ZipFile(archive) as opened:
        contents = {name: opened.read(name) for name in opened.namelist()}
    lines = [line.strip() for line in AUTHOR_CODE.splitlines() if len(line.strip()) > 12]
    for name, data in contents.items():
        text = data.decode("latin-1")
        for secret in [*SECRETS, *lines, str(folder), 'File "', '.py"']:
            assert secret not in text, (name, secret)
    assert "proprietary_encoder.1.weight" in names_path(archive).read_text()  # the map stays with the author


def _altered(archive: Path, target: Path, member: str, change) -> Path:
    with zipfile.ZipFile(archive) as source, zipfile.ZipFile(target, "w") as out:
        for name in source.namelist():
            data = source.read(name)
            out.writestr(name, change(data) if name == member else data)
    return target


def _flip(data: bytes) -> bytes:
    return data[:100] + bytes([data[100] ^ 1]) + data[101:]


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("altered", "member weights.bin was altered"),
        ("wrong-key", "its signature does not verify with"),
        ("truncated", "is truncated or not a package"),
        ("newer", "newer than this FAST reads (2): upgrade FAST"),
        ("wrong-shape", "each input is float32 of shape (1, 28, 28), but the package was made for float32 of"),
        ("fixed-key", "`optimizer.lr` is the package author's training recipe (open keys: strategy.*, run.epochs;"),
    ],
)
def test_a_bad_package_or_bad_data_is_refused_in_one_line_with_exit_code_2(packed, tmp_path, case, message):
    folder, archive, _ = packed
    extra = ["--set", "data.name=digits"]
    if case == "altered":
        archive = _altered(archive, tmp_path / "a.fastjob", "weights.bin", _flip)
    elif case == "wrong-key":
        make_keys(tmp_path / "stranger")
        (folder / "author.pub").rename(folder / "author.pub.keep")
        (tmp_path / "stranger.pub").rename(folder / "author.pub")
    elif case == "truncated":
        (tmp_path / "t.fastjob").write_bytes(archive.read_bytes()[:-300])
        archive = tmp_path / "t.fastjob"
    elif case == "newer":

        def newer(data: bytes) -> bytes:
            return json.dumps({**json.loads(data), "format": 3}).encode()

        archive = _altered(archive, tmp_path / "n.fastjob", "manifest.json", newer)
    elif case == "wrong-shape":
        extra = ["--set", "data.name=mnist5k"]
    else:
        extra += ["--set", "optimizer.lr=0.5"]
    try:
        done = _owner_trains(folder, archive, tmp_path / "run", *extra)
    finally:
        if case == "wrong-key":
            (folder / "author.pub.keep").rename(folder / "author.pub")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr


def test_fast_inspect_shows_what_a_package_holds_without_training(packed):
    folder, archive, _ = packed
    shown = subprocess.run([FAST, "inspect", str(archive), "--trust", str(folder / "author.pub")],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout
    assert "(verified)" in text and "input: float32 (1, 8, 8) per sample; label: class index, int64 ()" in text
    assert "metrics: loss, accuracy" in text and "opened by the author: strategy.*, run.epochs; fixed: none" in text
    assert "all on the allow-list): aten::_assert_tensor_metadata.default, aten::add_.Tensor" in text
    manifest = read_package(archive).manifest
    for name, digest in manifest["members"].items():
        assert f"sha256 {digest}" in text and name in text
    assert 'name = "sync"' in text


def refused_pack(tmp_path: Path, forward: str, job: dict | None = None) -> str:
    """The one-line error of packing a model (a Linear(64, 10) behind `forward`'s body, in a module of the author's
    beside the config), checked to be one line and to leave no archive."""
    (tmp_path / "authors_model.py").write_text(
        textwrap.dedent("""
        import torch
        from torch import nn

        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = nn.Linear(64, 10)

            def forward(self, x):
        """)
        + textwrap.indent(textwrap.dedent(forward), " " * 8)
        + "\n\ndef build():\n    return Model()\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(PackageError) as error:
            pack({**(job or {"data": {"name": "digits"}}), "model": {"factory": "authors_model:build"}},
                 tmp_path / "m.fastjob")  # fmt: skip
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("authors_model", None)
    message = str(error.value)
    assert len(message.splitlines()) == 1 and "the model cannot be packed" in message
    assert not (tmp_path / "m.fastjob").exists()
    return message


def test_what_torch_export_cannot_capture_fails_at_pack_time_in_one_line(tmp_path):
    message = refused_pack(
        tmp_path,
        """
        if x.sum() > 0:  # data-dependent Python control flow
            return self.linear(x.flatten(1))
        return -self.linear(x.flatten(1))
    """,
    )
    assert "authors_model.py:12 in forward" in message  # the construct: the author's data-dependent `if`


def test_the_owner_cannot_swap_the_model_of_a_package(packed):
    folder, archive, _ = packed
    key = str(folder / "author.pub")
    with pytest.raises(ConfigError, match="a packed job's model and loss come from its package"):
        fast.train(str(archive), data__name="digits", model__name="lenet", package__trusted_key=key)


def test_fast_compare_runs_its_variants_on_a_package(packed, tmp_path, no_orphans):
    folder, archive, _ = packed
    config = tmp_path / "compare.toml"
    config.write_text(
        f'[package]\npath = "{archive}"\ntrusted_key = "{folder / "author.pub"}"\n[data]\nname = "digits"\n'
        '[[variant]]\nname = "sync"\nstrategy = { name = "sync" }\n'
        '[[variant]]\nname = "local-sgd"\nstrategy = { name = "local-sgd", period = 4 }\n'
    )
    comparison = fast.compare(str(config), tmp_path / "out")
    assert not comparison.failed and [o.name for o in comparison.outcomes] == ["sync", "local-sgd"]
    for outcome in comparison.outcomes:
        summary = json.loads((outcome.run_dir / "summary.json").read_text())
        assert summary["final_test_accuracy"] > 0.8 and summary["config"]["package"]["path"] == str(archive)


@pytest.mark.parametrize("model", ["lenet", "resnet8"])
def test_the_built_in_image_models_pack_and_train_from_the_package(tmp_path, no_orphans, model):
    job = {"data": {"name": "digits"}, "model": {"name": model}, "run": {"workers": 2, "max_steps": 30,
           "batch_size": 32, "eval_every": 0}}  # fmt: skip
    archive = fast.pack(job, tmp_path / f"{model}.fastjob")
    summary = fast.train(str(archive), out=str(tmp_path / "run"), data__name="digits", package__unsigned=True)
    source = fast.train(job, out=str(tmp_path / "source"))
    assert summary["steps_per_worker"] == 30 and summary["final_test_loss"] < 2.3  # untrained: ln 10 = 2.303
    assert summary["final_test_accuracy"] == pytest.approx(source["final_test_accuracy"], abs=1e-6)
    assert not any(name.startswith("features") for name in torch.load(tmp_path / "run" / "model.pt"))


def test_the_language_model_packs_and_trains_from_the_package_under_diloco(tmp_path, no_orphans, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "lm"))
    monkeypatch.setenv("FAST_CODE_PATH", str(ROOT / "examples" / "lm"))  # the workers import the owner's data code
    small = {"model__width": 32, "model__layers": 1, "data__megabytes": 0.3, "run__workers": 2, "run__max_steps": 20,
             "run__log_every": 5, "run__eval_every": 0.0}  # fmt: skip
    archive = pack(str(ROOT / "examples" / "lm" / "lm.toml"), tmp_path / "lm.fastjob", open_keys=("strategy.*",),
                   **small)  # fmt: skip
    assert read_package(archive).schema["derived"] == ["perplexity"]
    summary = fast.train(str(archive), out=str(tmp_path / "run"), strategy__name="diloco", strategy__period=5,
                         data__factory="lm:corpus", data__context=128, data__megabytes=0.3,
                         package__unsigned=True)  # fmt: skip
    assert summary["steps_per_worker"] == 20 and summary["outer_rounds"] == 4
    assert 1 < summary["final_test_perplexity"] < 256  # a byte model guessing uniformly: 256


def test_fast_keys_makes_its_folder_and_never_overwrites_a_key(tmp_path):
    made = subprocess.run([FAST, "keys", "keys/author"], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert made.returncode == 0, made.stderr
    private = tmp_path / "keys" / "author.key"
    assert private.stat().st_mode & 0o777 == 0o600 and (tmp_path / "keys" / "author.pub").is_file()
    kept = private.read_bytes()
    again = subprocess.run([FAST, "keys", "keys/author"], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert again.returncode == 2 and len(again.stderr.strip().splitlines()) == 1
    assert "already exists" in again.stderr and private.read_bytes() == kept
