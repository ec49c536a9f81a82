"""The archive of a packed training job (`fast pack`), read as untrusted bytes and checked member by member,
without unpickling anything (the model it holds is run by fast.program).

The archive is a zip of:

    manifest.json   format version, FAST and torch versions, the SHA-256 and size of every other member, the
                    signer's key
    signature       ed25519 over manifest.json's bytes (when the author signed)
    config.toml     the training config the author resolved (strategy, codec, optimizer, schedule, run)
    schema.json     the batch (input shape and dtype without the batch dimension, label shape and dtype), the
                    metrics the evaluation program returns, and the config keys the author opened and fixed
    train.json      the training program: (x, y) -> the loss, in training mode (dropout on, batch norm batch
                    statistics and running-statistics updates)
    eval.json       the evaluation program: (x, y) -> (loss, metric, ...), in evaluation mode
    weights.json    the initial parameters and buffers (w0, w1, ... b0, ...): name, dtype, shape, offset
    weights.bin     their bytes, little-endian

Programs are torch.export graphs with every node's metadata (stack traces, module paths and class names)
removed and parameters named neutrally; the author keeps the map back to the real names beside the archive.

Reading (`read_package`) trusts nothing before it is checked: the zip's directory first (at most a few entries by
its classic end record and by any zip64 end record, plain names, no duplicates), then the manifest and its
signature, then only the members the manifest lists, each streamed up to its declared size and cap while its
SHA-256 is computed, then the programs against the operator allow-list (fast.operators). A member that is
unlisted, missing, duplicated, larger than declared or over its cap is refused before it is decompressed any
further.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
import tomllib
import zipfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from fast.errors import PackageError
from fast.ownership import holds_only_packed_tables
from fast.program import WEIGHT_NAME, Graph, read_graph

FORMAT = 2  # 2: member sizes in the manifest, opened and fixed keys in the schema
PACKAGE_SUFFIX = ".fastjob"
MANIFEST, SIGNATURE = "manifest.json", "signature"
PROGRAMS = ("train.json", "eval.json")
MEMBERS = ("config.toml", "schema.json", *PROGRAMS, "weights.json", "weights.bin")
MiB = 1 << 20
CAPS = {MANIFEST: MiB, SIGNATURE: 1024, "config.toml": MiB, "schema.json": MiB, "train.json": 256 * MiB,
        "eval.json": 256 * MiB, "weights.json": 64 * MiB, "weights.bin": 64 * 1024 * MiB}  # fmt: skip
CHUNK = MiB  # bytes decompressed at a time
DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (torch.float32, torch.float64, torch.float16,
          torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}  # fmt: skip
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")  # a metric's
KEY = re.compile(r"[A-Za-z0-9_.*\-]{1,100}")  # an opened or fixed config key's pattern


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- tensors without pickle -------------------------------------------------------------------------------------
def encode_tensors(tensors: dict[str, torch.Tensor]) -> tuple[bytes, bytes]:
    """(index as JSON, raw bytes) of named tensors: each its dtype, shape and place in the bytes."""
    index, blob, offset = [], bytearray(), 0
    for name, tensor in tensors.items():
        data = tensor.detach().cpu().contiguous()
        raw = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
        dtype = str(data.dtype).removeprefix("torch.")
        index.append({"name": name, "dtype": dtype, "shape": list(data.shape), "offset": offset, "bytes": len(raw)})
        blob += raw
        offset += len(raw)
    return json.dumps(index).encode(), bytes(blob)


def decode_tensors(index: bytes, blob: bytes | bytearray) -> dict[str, torch.Tensor]:
    """The tensors of weights.json's `index` in `blob`; PackageError for an entry that is not as fast pack writes
    it or does not fit."""
    try:
        entries = json.loads(index)
        tensors = {}
        for entry in entries:
            name, dtype, shape = entry["name"], DTYPES.get(entry["dtype"]), entry["shape"]
            start, size = entry["offset"], entry["bytes"]
            named = isinstance(name, str) and any(pattern.fullmatch(name) for pattern in WEIGHT_NAME.values())
            if not named or name in tensors:
                raise PackageError(f"weights.json names a tensor {str(name)[:40]!r}, not as fast pack names them")
            if dtype is None:
                raise PackageError(f"weights.json names dtype {str(entry['dtype'])[:20]!r}, which FAST does not read")
            if not all(type(v) is int and v >= 0 for v in (*shape, start, size)):
                raise PackageError(f"weights.json: tensor {name} has a malformed shape or place")
            expected = math.prod(shape) * dtype.itemsize
            if size != expected or start + expected > len(blob):
                raise PackageError(f"weights.json: tensor {name!r} does not fit weights.bin (a damaged package)")
            raw = bytearray(blob[start : start + expected])
            data = torch.frombuffer(raw, dtype=torch.uint8) if expected else torch.empty(0, dtype=torch.uint8)
            tensors[name] = data.view(dtype).reshape(shape).clone()
    except (ValueError, KeyError, TypeError, RuntimeError):
        raise PackageError("weights.json is not an index of tensors as fast pack writes it") from None
    return tensors


# -- the archive ------------------------------------------------------------------------------------------------
@dataclass
class Package:
    """A package read and checked: its members (bytes), manifest, programs, config and schema."""

    path: Path
    members: dict[str, bytes]
    manifest: dict[str, Any]
    signed_by: str | None  # the public key (hex) that signed it, when a signature is there
    graphs: dict[str, Graph]  # train.json and eval.json, checked against the operator allow-list

    @cached_property
    def config(self) -> dict[str, Any]:
        return tomllib.loads(self.members["config.toml"].decode())

    @cached_property
    def schema(self) -> dict[str, Any]:
        return json.loads(self.members["schema.json"])

    def weights(self) -> dict[str, torch.Tensor]:
        return decode_tensors(self.members["weights.json"], self.members["weights.bin"])


_last: tuple[tuple[Any, ...], Package] | None = None  # the package this process read last, and how it was read


def read_package(path: str | Path, trusted_key: str | Path | None = None) -> Package:
    """The package at `path`, read as untrusted bytes (see the module's docstring); with `trusted_key` (a PEM
    public key file) its signature must verify with that key. PackageError, in one line, for anything else. The
    same file (path, size and modification time) with the same key read again is not read twice."""
    global _last
    path = Path(path)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise PackageError(f"package {path} {what}: give the .fastjob file `fast pack` wrote")
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, str(trusted_key))
    if _last is not None and _last[0] == key:
        return _last[1]
    try:
        with open(path, "rb") as raw:
            _check_directory(path, raw)
            with zipfile.ZipFile(raw) as archive:
                package = _read(path, archive, trusted_key)
    except (zipfile.BadZipFile, EOFError, OSError) as e:
        raise PackageError(f"package {path} is truncated or not a package ({e}): ask its author for it again") from None
    except (zipfile.error, RuntimeError, NotImplementedError) as e:  # a bad CRC, an encrypted member
        raise PackageError(f"package {path} is damaged ({e}): ask its author for it again") from None
    _last = (key, package)
    return package


def _check_directory(path: Path, raw: Any) -> None:
    """Refuse a zip whose directory holds more entries than a package has, before zipfile reads them all: by its
    classic end record and, where a zip64 locator precedes it, by every zip64 end record zipfile may take instead
    (the one just before the locator, and the one the locator points at)."""
    size = raw.seek(0, os.SEEK_END)
    start = max(0, size - (1 << 16) - 22)
    raw.seek(start)
    tail = raw.read()
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or len(tail) - at < 22:
        raise PackageError(f"package {path} is truncated or not a package (no zip directory): ask its author for it "
                           "again")  # fmt: skip
    entries, directory_size = struct.unpack("<HI", tail[at + 10 : at + 16])
    records = [(entries, directory_size)]
    locator_at = start + at - 20
    if locator_at >= 0:
        raw.seek(locator_at)
        locator = raw.read(20)
        if locator[:4] == b"PK\x06\x07":
            (pointed,) = struct.unpack("<Q", locator[8:16])
            for record_at in {locator_at - 56, pointed}:
                if 0 <= record_at <= size - 56:
                    raw.seek(record_at)
                    record = raw.read(56)
                    if record[:4] == b"PK\x06\x06":
                        here, total, listed = struct.unpack("<QQQ", record[24:48])
                        records.append((max(here, total), listed))
    for entries, directory_size in records:
        if entries > 64 or directory_size > 64 * 1024:  # a package has 8
            raise PackageError(f"package {path} has {entries:,} entries, more than a package has: do not train it")
    raw.seek(0)


def check_trust(package: Package, trusted_key: str | Path | None, unsigned: Any) -> None:
    """The data owner's decision on trust, the one rule for every command that trains or runs a package: its
    signature verified with `trusted_key` (read_package did), or the owner said to train it unverified
    (`unsigned`, `--unsigned`); else PackageError naming both. Only `fast inspect` reads a package without it."""
    if unsigned not in (True, False, None):
        raise PackageError(f"package.unsigned = {str(unsigned)[:20]!r}: give true or false")
    if trusted_key is None and unsigned is not True:
        state = "signed, but its signature is not verified" if package.signed_by else "not signed"
        raise PackageError(f"package {package.path} is {state}: give its author's public key with --trust KEY.pub "
                           "(package.trusted_key), or pass --unsigned (package.unsigned = true) to train it "
                           "unverified, as you would run its author's code")  # fmt: skip


def _read(path: Path, archive: zipfile.ZipFile, trusted_key: str | Path | None) -> Package:
    entries: dict[str, zipfile.ZipInfo] = {}
    for info in archive.infolist():
        name = info.filename
        if name in entries:
            raise PackageError(f"package {path} holds two members named {name[:40]!r}: do not train it")
        if name not in (MANIFEST, SIGNATURE, *MEMBERS):
            shown = name[:40] if name.isprintable() else repr(name[:40])
            raise PackageError(f"package {path} holds a member {shown!r} that packages do not have: do not train it")
        entries[name] = info
    if MANIFEST not in entries:
        raise PackageError(f"package {path} has no {MANIFEST}: it was not written by `fast pack`")
    manifest_bytes = _member(path, archive, entries[MANIFEST], entries[MANIFEST].file_size)
    try:
        manifest = json.loads(manifest_bytes)
        version = int(manifest["format"])
    except (ValueError, KeyError, TypeError):
        raise PackageError(f"package {path}: its {MANIFEST} is not valid: ask its author for it again") from None
    if version > FORMAT:
        raise PackageError(f"package {path} has format {version}, newer than this FAST reads ({FORMAT}): upgrade FAST")
    if version < FORMAT:
        raise PackageError(f"package {path} has format {version}, from an older FAST whose packages are no longer "
                           "read: ask its author to pack it again")  # fmt: skip
    signature = None
    if SIGNATURE in entries:
        signature = _member(path, archive, entries[SIGNATURE], entries[SIGNATURE].file_size)
    signed_by = _check_signature(path, manifest_bytes, manifest, signature, trusted_key)
    listed, sizes = manifest.get("members"), manifest.get("sizes")
    if not isinstance(listed, dict) or not isinstance(sizes, dict) or not set(MEMBERS) == set(listed) == set(sizes):
        raise PackageError(f"package {path}: its {MANIFEST} does not list the members of a package: ask its author "
                           "for it again")  # fmt: skip
    for name in MEMBERS:
        if name not in entries:
            raise PackageError(f"package {path} lacks member {name}: it is incomplete; ask its author for it again")
        declared = sizes[name]
        if type(declared) is not int or declared != entries[name].file_size:
            raise PackageError(f"package {path}: member {name} is not the size its manifest declares: do not train it")
    members = {name: _member(path, archive, entries[name], sizes[name], listed[name]) for name in MEMBERS}
    schema = _checked_schema(path, members)
    graphs = {name: read_graph(members[name], name, training=name == "train.json") for name in PROGRAMS}
    _check_programs(path, graphs, members, schema)
    return Package(path, members, manifest, signed_by, graphs)


def _member(path: Path, archive: zipfile.ZipFile, info: zipfile.ZipInfo, size: int, digest: str | None = None) -> bytes:
    """A member's bytes, decompressed a chunk at a time up to `size` (refused past it or past its cap), and
    checked against its SHA-256 `digest`."""
    name = info.filename
    if size > CAPS[name]:
        raise PackageError(f"package {path}: member {name} declares {size:,} bytes, over the cap of {CAPS[name]:,} "
                           "for it: do not train it")  # fmt: skip
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED) or info.flag_bits & 0x1:
        raise PackageError(f"package {path}: member {name} is encrypted or compressed in a way fast pack does not "
                           "write: do not train it")  # fmt: skip
    data, hashed = bytearray(), hashlib.sha256()
    with archive.open(info) as stream:
        while chunk := stream.read(min(CHUNK, size + 1 - len(data))):
            data += chunk
            hashed.update(chunk)
            if len(data) > size:
                raise PackageError(f"package {path}: member {name} is larger than declared: do not train it")
    if len(data) != size:
        raise PackageError(f"package {path}: member {name} is shorter than declared: ask its author for it again")
    if digest is not None and hashed.hexdigest() != digest:
        raise PackageError(f"package {path}: member {name} was altered (its SHA-256 is not the manifest's); do not "
                           "train it, ask its author for it again")  # fmt: skip
    return bytes(data)


def _checked_schema(path: Path, members: dict[str, bytes]) -> dict[str, Any]:
    """schema.json, once config.toml is known to be TOML and the schema to describe a batch, metrics and keys as
    fast pack writes them."""
    try:
        ok = holds_only_packed_tables(tomllib.loads(members["config.toml"].decode()))
        schema = json.loads(members["schema.json"])
        ok = ok and isinstance(schema, dict) and schema["label"]["kind"] in ("class index", "tensor")
        for part in (schema["input"], schema["label"]):
            ok = ok and part["dtype"] in DTYPES and all(type(v) is int and v >= 0 for v in part["shape"])
        words = [*schema["metrics"], *schema["derived"]]
        ok = ok and all(isinstance(w, str) and NAME.fullmatch(w) for w in words)
        ok = ok and all(isinstance(k, str) and KEY.fullmatch(k) for k in [*schema["open"], *schema["fixed"]])
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise PackageError(f"package {path}: its config.toml or schema.json is malformed: ask its author for it again")
    return schema


def _check_programs(path: Path, graphs: dict[str, Graph], members: dict[str, bytes], schema: dict[str, Any]) -> None:
    """The programs take the weights the package holds, and return what the schema says (the loss; the loss and
    the metrics)."""
    try:
        names = sorted(entry["name"] for entry in json.loads(members["weights.json"]))
    except (ValueError, KeyError, TypeError):
        raise PackageError(f"package {path}: weights.json is malformed: ask its author for it again") from None
    for name, graph in graphs.items():
        if sorted(graph.weight_names) != names:
            raise PackageError(f"package {path}: {name} does not take the weights the package holds")
    if len(graphs["train.json"].outputs) != 1 or len(graphs["eval.json"].outputs) != 1 + len(schema["metrics"]):
        raise PackageError(f"package {path}: its programs do not return the loss and the metrics its schema names")


def _check_signature(path: Path, manifest_bytes: bytes, manifest: dict[str, Any], signature: bytes | None,
                     trusted_key: str | Path | None) -> str | None:  # fmt: skip
    signer = manifest.get("signer")
    if trusted_key is None:
        return signer if signature is not None and isinstance(signer, str) else None
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        key = serialization.load_pem_public_key(Path(trusted_key).read_bytes())
    except (OSError, ValueError) as e:
        raise PackageError(
            f"trusted key {trusted_key} cannot be read ({e}): give the author's PEM public key"
        ) from None
    if not isinstance(key, Ed25519PublicKey):
        raise PackageError(f"trusted key {trusted_key} is not an ed25519 public key: give the author's .pub file")
    if signature is None:
        raise PackageError(f"package {path} is not signed, but a trusted key was given: ask its author to sign it")
    try:
        key.verify(signature, manifest_bytes)
    except InvalidSignature:
        why = f"its signature does not verify with {trusted_key}; do not train it"
        raise PackageError(f"package {path}: {why}") from None
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return raw.hex()
