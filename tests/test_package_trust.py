"""A package is untrusted input at the data owner's site: signed by its author and still hostile, it cannot read,
create or overwrite the owner's files, run Python or custom operators, or exhaust memory with a zip bomb; and the
owner decides the deployment (the strategy included) without asking the author."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
import time
import warnings
import zipfile
import zlib
from pathlib import Path

import pytest
import torch

import fast
from fast.archive import CAPS, read_package
from fast.assemble import load_config
from fast.errors import ConfigError, PackageError
from fast.operators import OPERATORS
from fast.tools.pack import make_keys, pack, write_archive
from tests.test_pack import refused_pack

ROOT = Path(__file__).resolve().parents[1]
FAST = str(Path(sys.executable).with_name("fast"))
JOB = {"run": {"workers": 2, "epochs": 1, "batch_size": 32, "eval_every": 0, "seed": 1}, "data": {"name": "digits"}}
GiB = 1 << 30


@pytest.fixture(scope="module")
def author(tmp_path_factory):
    """A signed package of a small job, and the author's keys (which a hostile author signs altered packages with)."""
    folder = tmp_path_factory.mktemp("author")
    make_keys(folder / "author")
    return folder, pack(JOB, folder / "job.fastjob", sign=folder / "author.key")


def _members(archive: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(archive) as opened:
        return {name: opened.read(name) for name in opened.namelist() if name not in ("manifest.json", "signature")}


def _resigned(author, target: Path, change) -> Path:
    """The author's package with its training program changed by `change(graph)`, signed again by the author."""
    folder, archive = author
    members = _members(archive)
    graph = json.loads(members["train.json"])
    change(graph)
    members["train.json"] = json.dumps(graph).encode()
    return write_archive(target, members, folder / "author.key")


def _owner(author, *command: str, cwd: Path) -> subprocess.CompletedProcess:
    folder, _ = author
    return subprocess.run([FAST, *command, "--trust", str(folder / "author.pub")], capture_output=True, text=True,
                          cwd=cwd, timeout=300)  # fmt: skip


def _one_line(done: subprocess.CompletedProcess, *words: str) -> None:
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and all(word in lines[0] for word in words), done.stderr


def _node(target: str, inputs: list[tuple[str, dict]], output: str) -> dict:
    """A graph node as torch.export writes it (`dtype` passed by keyword, as it is keyword-only)."""
    arguments = [{"name": n, "arg": a, "kind": 2 if n == "dtype" else 1} for n, a in inputs]
    return {"target": target, "inputs": arguments, "outputs": [{"as_tensor": {"name": output}}], "metadata": {},
            "name": output}  # fmt: skip


def _from_file(path: Path, shared: bool, size: int) -> list[dict]:
    """Nodes that map `path` (as aten::from_file does), zero it when shared, and add its bytes' sum to the loss."""
    file = [("filename", {"as_string": str(path)}), ("shared", {"as_bool": shared}), ("size", {"as_int": size}),
            ("dtype", {"as_scalar_type": 1})]  # fmt: skip
    nodes = [_node("torch.ops.aten.from_file.default", file, "stolen")]
    if shared:
        nodes.append(_node("torch.ops.aten.fill_.Scalar", [("self", {"as_tensor": {"name": "stolen"}}),
                                                           ("value", {"as_int": 0})], "zeroed"))  # fmt: skip
    nodes.append(_node("torch.ops.aten.sum.default", [("self", {"as_tensor": {"name": "stolen"}})], "total"))
    return nodes


def _poison(nodes: list[dict]):
    """A change that adds `nodes` before the loss is returned, and the last one's value into the loss."""

    def change(graph: dict) -> None:
        body = graph["graph_module"]
        loss = body["graph"]["outputs"][0]["as_tensor"]["name"]
        added = [
            *nodes,
            _node(
                "torch.ops.aten.add.Tensor",
                [("self", {"as_tensor": {"name": loss}}), ("other", {"as_tensor": {"name": "total"}})],
                "poisoned",
            ),
        ]
        body["graph"]["nodes"] += added
        for node in added:  # torch's own deserializer wants a description of every value (FAST reads none)
            body["graph"]["tensor_values"][node["name"]] = body["graph"]["tensor_values"][loss]
        body["graph"]["outputs"] = [{"as_tensor": {"name": "poisoned"}}]
        body["signature"]["output_specs"] = [{"user_output": {"arg": {"as_tensor": {"name": "poisoned"}}}}]

    return change


def test_the_attack_is_real_torch_s_own_loader_reads_the_file(author, tmp_path):
    """The from_file package below, loaded as FAST did before the allow-list (torch's deserializer), reads the
    owner's file into the loss: so the refusals that follow are refusals of a working attack."""
    from torch._export.serde.serialize import SerializedArtifact, deserialize

    secret = tmp_path / "secret"
    secret.write_bytes(bytes([7]) * 16)
    archive = _resigned(author, tmp_path / "read.fastjob", _poison(_from_file(secret, False, 16)))
    members = _members(archive)
    clean = read_package(author[1])
    state = {n: torch.nn.Parameter(t) if n.startswith("w") else t for n, t in clean.weights().items()}
    x, y = torch.zeros(4, 1, 8, 8), torch.zeros(4, dtype=torch.int64)
    module = deserialize(SerializedArtifact(members["train.json"], state, {}, ((x, y), {}))).module()
    honest = deserialize(SerializedArtifact(clean.members["train.json"], state, {}, ((x, y), {}))).module()
    assert float((module(x, y) - honest(x, y)).detach()) == pytest.approx(16 * 7)


@pytest.mark.parametrize("attack", ["read", "create", "overwrite"])
def test_a_signed_package_calling_from_file_is_refused_and_touches_nothing(author, tmp_path, attack):
    owner = tmp_path / "owner"
    owner.mkdir()
    secret, created = owner / "secret.txt", owner / "created-by-the-package"
    secret.write_bytes(b"the owner's own file")
    path, shared, size = {"read": (secret, False, 20), "create": (created, True, 4096),
                          "overwrite": (secret, True, 8)}[attack]  # fmt: skip
    archive = _resigned(author, tmp_path / f"{attack}.fastjob", _poison(_from_file(path, shared, size)))
    for command in (["inspect", str(archive)], ["train", str(archive), "--out", str(tmp_path / "run")]):
        _one_line(_owner(author, *command, cwd=owner), "aten::from_file.default", "not on FAST's operator allow-list")
    assert secret.read_bytes() == b"the owner's own file" and not created.exists()
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.parametrize(
    ("target", "words"),
    [
        ("torch.ops.evil.read_file.default", "outside the aten namespace"),  # a custom operator
        ("builtins.open", "a Python callable"),
        ("torch.ops.higher_order.wrap_with_set_grad_enabled", "outside the aten namespace"),
        ("torch.ops.aten.empty.memory_format", "aten::empty.memory_format, which is not on"),  # uninitialised memory
        ("torch.ops.aten.set_.source_Storage", "aten::set_.source_Storage, which is not on"),
    ],
)
def test_operators_off_the_list_are_refused_at_inspect_and_at_train(author, tmp_path, target, words):
    node = _node(target, [("self", {"as_tensor": {"name": "x"}})], "total")
    archive = _resigned(author, tmp_path / "p.fastjob", _poison([node]))
    _one_line(_owner(author, "inspect", str(archive), cwd=tmp_path), words)
    _one_line(_owner(author, "train", str(archive), "--out", str(tmp_path / "run"), cwd=tmp_path), words)


@pytest.mark.parametrize(
    ("argument", "words"),
    [
        ({"as_string": "/etc/passwd"}, "passes aten::gelu.default the string '/etc/passwd'"),
        ({"as_custom_obj": {"name": "o", "class_fqn": "x"}}, "a custom_obj as 'approximate'"),
        ({"as_graph": {"name": "g"}}, "a graph as 'approximate'"),
    ],
)
def test_arguments_that_are_not_tensors_numbers_dtypes_or_devices_are_refused(author, tmp_path, argument, words):
    gelu = _node("torch.ops.aten.gelu.default", [("self", {"as_tensor": {"name": "x"}}), ("approximate", argument)],
                 "squashed")  # fmt: skip
    summed = _node("torch.ops.aten.sum.default", [("self", {"as_tensor": {"name": "squashed"}})], "total")
    archive = _resigned(author, tmp_path / "p.fastjob", _poison([gelu, summed]))
    with pytest.raises(PackageError, match="train.json: its graph passes") as error:
        read_package(archive)
    assert words in str(error.value)


def test_python_hidden_in_the_graphs_guards_and_sizes_never_runs(author, tmp_path):
    """torch.export writes shape guards as Python and sizes as sympy expressions, which torch's deserializer
    evaluates; FAST never reads them, so a package that hides code there trains and the code never runs."""
    marks = [tmp_path / "guards-ran", tmp_path / "sizes-ran"]

    def hide(graph: dict) -> None:
        graph["guards_code"] = [f"__import__('os').system('touch {marks[0]}') == 0"]
        graph["graph_module"]["graph"]["sym_int_values"] = {
            "s": {"as_expr": {"expr_str": f"__import__('os').system('touch {marks[1]}')", "hint": None}}
        }
        graph["range_constraints"] = {"s": {"min_val": 1, "max_val": None}}

    archive = _resigned(author, tmp_path / "hidden.fastjob", hide)
    done = _owner(author, "train", str(archive), "--out", str(tmp_path / "run"), "--set", "data.name=digits",
                  cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert not any(mark.exists() for mark in marks)


# -- the archive as hostile bytes ---------------------------------------------------------------------------------
class _ZeroBlocks:
    """Deflate for a run of zero blocks of one size, compressed once: a full flush after each block resets the
    compressor, so every block deflates to the same bytes (a 2 GiB member is written in a second, not in six)."""

    def __init__(self, size: int) -> None:
        deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
        self.size, self.block = size, deflate.compress(bytes(size)) + deflate.flush(zlib.Z_FULL_FLUSH)
        self.end = deflate.flush()

    def compress(self, data: bytes) -> bytes:
        assert len(data) == self.size and not any(data[:: 1 << 12]), "only whole zero blocks"
        return self.block

    def flush(self) -> bytes:
        return self.end


def _zeros_member(archive: zipfile.ZipFile, name: str, size: int) -> None:
    """A member of `size` zero bytes (a whole number of mebibytes), written a mebibyte at a time (its compressed form
    is small)."""
    info = zipfile.ZipInfo(name)
    info.compress_type = zipfile.ZIP_DEFLATED
    block = bytes(1 << 20)
    assert size % len(block) == 0
    with archive.open(info, "w", force_zip64=size >= 1 << 31) as out:
        out._compressor = _ZeroBlocks(len(block))  # (zipfile's own, fed the same block 2,048 times, takes seconds)
        for _ in range(size // len(block)):
            out.write(block)


def _bomb(author, target: Path, case: str) -> Path:
    """The author's signed package plus a member that decompresses to about 2 GiB: unlisted; listed as
    weights.bin with its real size in the zip but not in the manifest; or with a zip header that lies too."""
    _, archive = author
    with zipfile.ZipFile(archive) as source, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as out:
        for info in source.infolist():
            if case != "unlisted" and info.filename == "weights.bin":
                _zeros_member(out, "weights.bin", 2 * GiB - (1 << 20) if case == "lying" else 2 * GiB)
            else:
                out.writestr(info, source.read(info.filename))
        if case == "unlisted":
            _zeros_member(out, "bomb.bin", 2 * GiB)
    if case == "lying":  # weights.bin's two headers, local and central, now say the manifest's size
        declared = read_package(archive).manifest["sizes"]["weights.bin"]
        data = bytearray(target.read_bytes())
        for signature, size_at, name_at in ((b"PK\x03\x04", 22, 30), (b"PK\x01\x02", 24, 46)):
            at = data.find(signature)
            while at >= 0:
                if data[at + name_at : at + name_at + 11] == b"weights.bin":
                    data[at + size_at : at + size_at + 4] = struct.pack("<I", declared)
                at = data.find(signature, at + 4)
        target.write_bytes(bytes(data))
    return target


@pytest.mark.parametrize(("case", "words"), [
    ("unlisted", "holds a member 'bomb.bin' that packages do not have"),
    ("oversized", "member weights.bin is not the size its manifest declares"),
    ("lying", "is truncated or not a package"),
])  # fmt: skip
def test_a_zip_bomb_is_refused_within_a_second_and_bounded_memory(author, tmp_path, case, words):
    bomb = _bomb(author, tmp_path / f"{case}.fastjob", case)
    assert bomb.stat().st_size < 20 * (1 << 20)
    # the peak from /proc (VmHWM): getrusage's maxrss would count the forked copy of pytest before exec
    probe = textwrap.dedent(f"""
        import json, re, time
        from fast.archive import read_package
        from fast.errors import PackageError
        start = time.perf_counter()
        try:
            read_package({str(bomb)!r}, {str(author[0] / "author.pub")!r})
            message = "accepted"
        except PackageError as e:
            message = str(e)
        took = time.perf_counter() - start
        peak_kb = int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1))
        print(json.dumps({{"message": message, "seconds": took, "peak_mb": peak_kb / 1024}}))
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    result = json.loads(done.stdout)
    assert words in result["message"], result
    assert result["seconds"] < 1.0 and result["peak_mb"] < 300, result  # decompressing it: ~10 s and 2+ GB


def _rezipped(author, target: Path, entries: list[tuple[str, bytes]]) -> Path:
    with zipfile.ZipFile(target, "w") as out:
        for name, data in entries:
            out.writestr(name, data)
    return target


def _entries(author) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(author[1]) as source:
        return [(name, source.read(name)) for name in source.namelist()]


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("missing", "lacks member eval.json"),
        ("duplicate", "holds two members named 'config.toml'"),
        ("path", "holds a member '../config.toml' that packages do not have"),
        ("unlisted-in-manifest", "its manifest.json does not list the members of a package"),
        ("old-format", "from an older FAST whose packages are no longer read"),
        ("many-entries", "entries, more than a package has"),
    ],
)
def test_a_malformed_archive_is_refused_in_one_line(author, tmp_path, case, words):
    entries = _entries(author)
    if case == "missing":  # the manifest (signed) still lists it
        entries = [(n, d) for n, d in entries if n != "eval.json"]
    elif case == "duplicate":
        entries.append(("config.toml", b'[strategy]\nname = "gossip"\n'))
    elif case == "path":
        entries.append(("../config.toml", b""))
    elif case in ("unlisted-in-manifest", "old-format"):
        manifest = json.loads(dict(entries)["manifest.json"])
        if case == "old-format":
            manifest["format"] = 1
        else:
            manifest["members"]["extra.bin"] = manifest["members"].pop("eval.json")
        entries = [(n, json.dumps(manifest).encode() if n == "manifest.json" else d) for n, d in entries
                   if n != "signature"]  # fmt: skip
    else:
        entries += [(f"m{i}", b"") for i in range(5000)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns of the duplicate it is asked to write
        archive = _rezipped(author, tmp_path / f"{case}.fastjob", entries)
    trust = [] if case in ("unlisted-in-manifest", "old-format") else ["--trust", str(author[0] / "author.pub")]
    done = subprocess.run([FAST, "inspect", str(archive), *trust], capture_output=True, text=True, timeout=120)
    _one_line(done, words)


def test_member_caps_cover_every_member():
    assert set(CAPS) == {"manifest.json", "signature", "config.toml", "schema.json", "train.json", "eval.json",
                         "weights.json", "weights.bin"}  # fmt: skip


# -- the allow-list holds the real models ---------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["mlp", "lenet", "lstm", "resnet8"])
def test_the_graphs_of_every_built_in_model_pass_the_allow_list(tmp_path, model):
    archive = pack({**JOB, "model": {"name": model}}, tmp_path / f"{model}.fastjob")
    package = read_package(archive)
    used = {name for graph in package.graphs.values() for name in graph.operators}
    assert used and all(name.split("::")[1].split(".")[0].removesuffix("_") in OPERATORS for name in used)


def test_the_language_models_graphs_pass_the_allow_list(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "lm"))
    small = {"model__width": 32, "model__layers": 1, "data__megabytes": 0.2, "run__workers": 2}
    package = read_package(pack(str(ROOT / "examples" / "lm" / "lm.toml"), tmp_path / "lm.fastjob", **small))
    assert "aten::scaled_dot_product_attention.default" in package.graphs["train.json"].operators


def test_a_model_that_calls_an_operator_off_the_list_cannot_be_packed(tmp_path):
    message = refused_pack(tmp_path, "return self.linear(torch.special.bessel_j0(x.flatten(1)))", JOB)
    assert "aten::special_bessel_j0.default, which is not on FAST's operator allow-list" in message


# -- the deployment is the owner's ----------------------------------------------------------------------------------
def test_the_owner_trains_a_package_under_gossip_without_the_author_opening_anything(author, tmp_path, no_orphans):
    assert read_package(author[1]).schema["open"] == []
    done = _owner(author, "train", str(author[1]), "--out", str(tmp_path / "run"), "--set", "data.name=digits",
                  "--set", "strategy.name=gossip", "--set", "strategy.topology=ring", "--set", "run.workers=3",
                  cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["config"]["strategy"]["name"] == "gossip" and summary["config"]["run"]["workers"] == 3


def test_the_authors_recipe_and_fixed_keys_stay_the_authors(author, tmp_path):
    folder, archive = author
    with pytest.raises(ConfigError, match="`optimizer.lr` is the package author's training recipe"):
        fast.train(str(archive), optimizer__lr=0.5, package__trusted_key=str(folder / "author.pub"))
    fixed = pack(JOB, tmp_path / "fixed.fastjob", fixed_keys=("strategy.*",), open_keys=("optimizer.lr",))
    with pytest.raises(ConfigError, match=r"`strategy.name` is fixed by the package's author"):
        fast.train(str(fixed), strategy__name="gossip", package__unsigned=True)
    config = load_config(str(fixed), optimizer__lr=0.01, run__workers=3, package__unsigned=True)
    assert config.optimizer.lr == 0.01 and config.run.workers == 3


def test_the_owners_keys_in_a_packages_config_are_not_defaults_the_owner_never_chose(author, tmp_path):
    """An author who writes the owner's keys into the package (an address on every interface, emulated faults) sets
    nothing: the owner's defaults apply, and the owner's own values win."""
    folder, archive = author
    members = _members(archive)
    members["config.toml"] += b'\n[network]\nbandwidth = "1kbit"\n'
    members["config.toml"] = members["config.toml"].replace(b'master_addr = "127.0.0.1"', b'master_addr = "0.0.0.0"')
    assert b'master_addr = "0.0.0.0"' in members["config.toml"]
    # (and a package written before `run.elastic` became `run.membership` still reads)
    members["config.toml"] = members["config.toml"].replace(b'membership = "fixed"', b"elastic = false")
    assert b"elastic = false" in members["config.toml"]
    hostile = write_archive(tmp_path / "hostile.fastjob", members, folder / "author.key")
    trusted = str(folder / "author.pub")
    config = load_config(str(hostile), package__trusted_key=trusted)
    assert config.run.master_addr == "127.0.0.1" and config.network is None
    assert load_config(str(hostile), package__trusted_key=trusted, run__workers=3).run.workers == 3


@pytest.mark.parametrize(
    ("keys", "words"),
    [
        ({"fixed_keys": ("data.name",)}, "the owner's data, machines and run folder are always theirs"),
        ({"open_keys": ("model.*",)}, "the model and loss are the package's graphs"),
        ({"open_keys": ("stratgy.name",)}, "is not a config key"),
        ({"open_keys": ("run.epochs",), "fixed_keys": ("run.epochs",)}, "is both opened and fixed"),
    ],
)
def test_the_authors_open_and_fixed_keys_are_checked_at_pack_time(tmp_path, keys, words):
    with pytest.raises(PackageError, match=words):
        pack(JOB, tmp_path / "p.fastjob", **keys)
    assert not os.path.exists(tmp_path / "p.fastjob")


# -- sizes come from sizes, and no node allocates past the owner's budget -----------------------------------------
def _sym(node: dict, name: str) -> dict:
    """`node` with its result declared a size (as_sym_int), as a graph names a tensor's size."""
    return {**node, "outputs": [{"as_sym_int": {"as_name": name}}]}


def _sizes(*items) -> dict:
    """A size list of constants (ints) and computed sizes (names)."""
    return {"as_sym_ints": [{"as_int": i} if isinstance(i, int) else {"as_name": i} for i in items]}


def _filled(size: dict) -> list[dict]:
    """full(size, 1.0), summed into `total`."""
    full = _node("torch.ops.aten.full.default", [("size", size), ("fill_value", {"as_float": 1.0})], "filled")
    return [full, _node("torch.ops.aten.sum.default", [("self", {"as_tensor": {"name": "filled"}})], "total")]


def _arange(target: str, arguments: list[tuple[str, dict]]) -> list[dict]:
    arange = _node(target, arguments, "counted")
    return [arange, _node("torch.ops.aten.sum.default", [("self", {"as_tensor": {"name": "counted"}})], "total")]


@pytest.mark.parametrize(
    ("nodes", "words"),
    [
        # the issue's bypass: the batch's sum declared a size, feeding full(size=[s, 0])
        ([_sym(_node("torch.ops.aten.sum.default", [("self", {"as_tensor": {"name": "x"}})], "s"), "s"),
          *_filled(_sizes("s", 0))], "(aten::sum.default) gives a size, but sizes come only from sym_size"),
        (_arange("torch.ops.aten.arange.default", [("end", {"as_float": 1e12})]),
         "(aten::arange.default) is given end=1e+12, beyond 2147483647"),
        (_arange("torch.ops.aten.arange.start_step", [("start", {"as_int": 0}), ("end", {"as_int": 10**9}),
                                                      ("step", {"as_float": 1e-6})]),
         "(aten::arange.start_step) is asked for 1,000,000,000,000,000 values"),
        # a size's result used as a tensor, to reach where only tensors go
        ([{**_node("torch.ops.aten.sym_size.int", [("self", {"as_tensor": {"name": "x"}}), ("dim", {"as_int": 0})],
                   "total")}], "(aten::sym_size.int) gives its size as a tensor"),
    ],
)  # fmt: skip
def test_a_size_not_from_sizes_or_an_unbounded_count_is_refused_at_load(author, tmp_path, nodes, words):
    archive = _resigned(author, tmp_path / "p.fastjob", _poison(nodes))
    with pytest.raises(PackageError, match=r"^train\.json: node \d+ ") as error:
        read_package(archive, author[0] / "author.pub")
    assert words in str(error.value) and len(str(error.value).splitlines()) == 1


def test_a_size_from_the_data_is_refused_by_fast_train_in_one_line(author, tmp_path):
    nodes = [_sym(_node("torch.ops.aten.sum.default", [("self", {"as_tensor": {"name": "x"}})], "s"), "s"),
             *_filled(_sizes("s", 0))]  # fmt: skip
    archive = _resigned(author, tmp_path / "p.fastjob", _poison(nodes))
    done = _owner(author, "train", str(archive), "--out", str(tmp_path / "run"), cwd=tmp_path)
    _one_line(done, "train.json: node", "(aten::sum.default) gives a size", "do not train it")


def test_a_node_allocating_past_the_budget_from_constant_sizes_is_refused_before_training(author, tmp_path):
    archive = _resigned(author, tmp_path / "p.fastjob", _poison(_filled(_sizes(2**31 - 1, 16))))
    done = _owner(author, "train", str(archive), "--out", str(tmp_path / "run"), "--set", "data.name=digits",
                  cwd=tmp_path)  # fmt: skip
    _one_line(done, "(aten::full.default) would allocate 128 GiB from the sizes it is given, over the 4 GiB",
              "raise package.max_node_gib")  # fmt: skip
    assert not (tmp_path / "run" / "summary.json").exists()
    key = str(author[0] / "author.pub")
    config = load_config(str(archive), data__name="digits", package__trusted_key=key, package__max_node_gib=256)
    assert config.package.node_bytes == 256 << 30  # the owner may raise it (this test trains nothing)
    assert "aten::full.default" in read_package(archive, key).graphs["train.json"].operators  # inspect reads it


def test_a_node_allocating_past_the_budget_from_sizes_computed_at_run_time_is_refused_as_it_runs(author, tmp_path):
    """sizes that pass the load (computed from the batch's size), whose product is 64 GiB at a batch of 32."""
    batch = _node("torch.ops.aten.sym_size.int", [("self", {"as_tensor": {"name": "x"}}), ("dim", {"as_int": 0})], "s")
    times = _node("_operator.mul", [("a", {"as_sym_int": {"as_name": "s"}}), ("b", {"as_int": 2**25})], "n")
    archive = _resigned(author, tmp_path / "p.fastjob", _poison([_sym(batch, "s"), _sym(times, "n"),
                                                                 *_filled(_sizes("n", 16))]))  # fmt: skip
    from fast.jobs.package import PackedModel

    package = read_package(archive, author[0] / "author.pub")
    x, y = torch.zeros(32, 1, 8, 8), torch.zeros(32, dtype=torch.int64)
    with pytest.raises(PackageError, match=r"^train\.json: node \d+ \(aten::full.default\) would allocate 64 GiB"):
        PackedModel(package)(x, y)
    with pytest.raises(PackageError, match="would allocate 2 GiB from the sizes it is given, over the 1 GiB one"):
        PackedModel(package, budget=1 << 30)(x[:1], y[:1])  # the owner's own budget (package.max_node_gib)


# -- in-place writes: never into the owner's batch or the weights outside training -----------------------------------
def _with_nodes(nodes: list[dict]):
    """A change that adds `nodes` (whose results nothing reads) to a program."""

    def change(graph: dict) -> None:
        graph["graph_module"]["graph"]["nodes"] += nodes

    return change


def _resigned_program(author, target: Path, program: str, change) -> Path:
    folder, archive = author
    members = _members(archive)
    graph = json.loads(members[program])
    change(graph)
    members[program] = json.dumps(graph).encode()
    return write_archive(target, members, folder / "author.key")


def _tensor(name: str) -> dict:
    return {"as_tensor": {"name": name}}


@pytest.mark.parametrize(
    ("program", "nodes", "words"),
    [
        # the issue's case: the evaluation program copies the owner's batch into a weight that is sent back
        ("eval.json", [_node("torch.ops.aten.copy_.default", [("self", _tensor("p_w0")), ("src", _tensor("x"))],
                             "copied")], "(aten::copy_.default) writes in place into the parameter w0"),
        ("eval.json", [_node("torch.ops.aten.view.default", [("self", _tensor("p_w1")), ("size", {"as_ints": [-1]})],
                             "flat"),
                       _node("torch.ops.aten.index_put_.default", [("self", _tensor("flat")), ("indices",
                             {"as_optional_tensors": [_tensor("y")]}), ("values", _tensor("y"))], "put")],
         "(aten::index_put_.default) writes in place into the parameter w1"),
        # the training program changes its parameters only through the optimizer
        ("train.json", [_node("torch.ops.aten.add_.Tensor", [("self", _tensor("p_w0")), ("other", {"as_int": 1})],
                              "added")], "(aten::add_.Tensor) writes in place into the parameter w0"),
        # and never the owner's batch, through a view of it either
        ("train.json", [_node("torch.ops.aten.reshape.default", [("self", _tensor("x")), ("shape", {"as_ints": [-1]})],
                              "flat"),
                        _node("torch.ops.aten.fill_.Scalar", [("self", _tensor("flat")), ("value", {"as_int": 0})],
                              "zeroed")], "(aten::fill_.Scalar) writes in place into an input of the program"),
    ],
)  # fmt: skip
def test_an_in_place_write_into_the_batch_or_a_weight_is_refused_at_load(author, tmp_path, program, nodes, words):
    archive = _resigned_program(author, tmp_path / "p.fastjob", program, _with_nodes(nodes))
    done = _owner(author, "inspect", str(archive), cwd=tmp_path)
    _one_line(done, f"{program}: node", words, "do not train it")


# -- the owner decides on trust -------------------------------------------------------------------------------------
COMPARE = '[package]\npath = "{archive}"\n[data]\nname = "digits"\n[[variant]]\nname = "sync"\n'


@pytest.mark.parametrize("command", ["train", "run", "compare"])
@pytest.mark.parametrize("signed", [True, False])
def test_a_package_no_trusted_key_verified_is_refused_without_unsigned(author, tmp_path, command, signed):
    archive = author[1] if signed else pack(JOB, tmp_path / "unsigned.fastjob")
    (tmp_path / "loop.py").write_text("raise SystemExit('the script ran')\n")
    (tmp_path / "compare.toml").write_text(COMPARE.format(archive=archive))
    argv = {"train": ["train", str(archive)], "run": ["run", "--config", str(archive), str(tmp_path / "loop.py")],
            "compare": ["compare", str(tmp_path / "compare.toml")]}[command]  # fmt: skip
    done = subprocess.run([FAST, *argv, "--out", str(tmp_path / "out")], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)  # fmt: skip
    state = "is signed, but its signature is not verified" if signed else "is not signed"
    _one_line(done, state, "give its author's public key with --trust KEY.pub", "or pass --unsigned")
    assert not (tmp_path / "out").exists()


def test_the_owner_says_so_to_train_an_unverified_package_and_inspect_needs_no_key(author, tmp_path):
    with pytest.raises(PackageError, match="is signed, but its signature is not verified"):
        fast.train(str(author[1]), data__name="digits")
    assert load_config(str(author[1]), data__name="digits", package__unsigned=True).package.unsigned
    shown = subprocess.run([FAST, "inspect", str(author[1])], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "(not verified: pass --trust)" in shown.stdout, shown.stderr


def test_a_package_cannot_decide_the_owners_trust_or_limits(author, tmp_path):
    """A [package] table in the package's own config (unsigned, a raised budget) is refused: fast pack never writes
    one, and the owner's trust and limits are the owner's."""
    folder, archive = author
    members = _members(archive)
    members["config.toml"] += b"\n[package]\nunsigned = true\nmax_node_gib = 1000\n"
    altered = write_archive(tmp_path / "p.fastjob", members, folder / "author.key")
    with pytest.raises(PackageError, match="its config.toml or schema.json is malformed"):
        read_package(altered, folder / "author.pub")


# -- every end record of the zip ----------------------------------------------------------------------------------
def test_a_zip64_end_record_that_lies_past_the_classic_one_is_refused_before_zipfile_reads_it(author, tmp_path,
                                                                                             monkeypatch):  # fmt: skip
    """A real zip of 70,000 entries (zip64: its classic end record cannot count them), whose classic end record is
    then made to claim the 8 entries and small directory of a package; zipfile takes the zip64 record's counts."""
    liar = tmp_path / "liar.fastjob"
    with zipfile.ZipFile(liar, "w") as out:
        for name, data in _entries(author):
            out.writestr(name, data)
        for i in range(70_000 - 8):
            out.writestr(f"m{i}", b"")
    data = bytearray(liar.read_bytes())
    end = data.rfind(b"PK\x05\x06")
    assert data.rfind(b"PK\x06\x07") == end - 20  # the zip64 locator, then the classic end record
    data[end + 8 : end + 16] = struct.pack("<HHI", 8, 8, 1000)  # entries on this disk, in all; directory bytes
    liar.write_bytes(bytes(data))
    assert len(zipfile.ZipFile(liar).infolist()) == 70_000  # what zipfile believes

    parsed = []
    original = zipfile.ZipFile._RealGetContents
    monkeypatch.setattr(zipfile.ZipFile, "_RealGetContents", lambda self: parsed.append(1) or original(self))
    started = time.perf_counter()
    with pytest.raises(PackageError, match="has 70,000 entries, more than a package has: do not train it"):
        read_package(liar, author[0] / "author.pub")
    assert time.perf_counter() - started < 0.1 and not parsed
