"""The archive of a packed training job (`fast pack`), read and checked member by member, without unpickling
anything (the model it holds is loaded by fast.jobs.package).

The archive is a zip of:

    manifest.json   format version, FAST and torch versions, the SHA-256 of every other member, the signer's key
    signature       ed25519 over manifest.json's bytes (when the author signed)
    config.toml     the training config the author resolved (strategy, codec, optimizer, schedule, run)
    schema.json     the batch (input shape and dtype without the batch dimension, label shape and dtype), the
                    metrics the evaluation program returns, and the config keys the author left open
    train.json      the training program: (x, y) -> the loss, in training mode (dropout on, batch norm batch
                    statistics and running-statistics updates)
    eval.json       the evaluation program: (x, y) -> (loss, metric, ...), in evaluation mode
    weights.json    the initial parameters and buffers (w0, w1, ... b0, ...): name, dtype, shape, offset
    weights.bin     their bytes, little-endian

Programs are torch.export graphs with every node's metadata (stack traces, module paths and class names)
removed and parameters named neutrally; the author keeps the map back to the real names beside the archive.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import math
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fast.errors import PackageError

FORMAT = 1
PACKAGE_SUFFIX = ".fastjob"
# keys the data owner sets whatever the author left open: their data, their machines and links, their run folder
OWNER_KEYS = ("data.*", "package.*", "network.*", "compute.*", "faults.*", "eval.batch_size", "eval.samples",
              "run.name", "run.device", "run.master_addr", "run.master_port", "run.threads_per_worker",
              "run.deadline_s", "run.log_every", "run.eval_every", "run.targets", "run.tensorboard", "run.trace",
              "run.checkpoint_every", "run.max_restarts")  # fmt: skip
MANIFEST, SIGNATURE = "manifest.json", "signature"
MEMBERS = ("config.toml", "schema.json", "train.json", "eval.json", "weights.json", "weights.bin")
DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (torch.float32, torch.float64, torch.float16,
          torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}  # fmt: skip


def owner_may_set(key: str, opened: list[str]) -> bool:
    """Whether the data owner may set config `key` of a packed job (`opened`: the author's open keys, patterns
    such as "strategy.*")."""
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in (*OWNER_KEYS, *opened))


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


def decode_tensors(index: bytes, blob: bytes) -> dict[str, torch.Tensor]:
    tensors = {}
    for entry in json.loads(index):
        dtype = DTYPES.get(entry["dtype"])
        if dtype is None:
            raise PackageError(f"weights.json names dtype {entry['dtype']!r}, which this FAST does not read")
        shape, start = tuple(entry["shape"]), entry["offset"]
        expected = math.prod(shape) * dtype.itemsize
        if entry["bytes"] != expected or start + expected > len(blob):
            raise PackageError(f"weights.json: tensor {entry['name']!r} does not fit weights.bin (a damaged package)")
        if expected == 0:
            tensors[entry["name"]] = torch.empty(shape, dtype=dtype)
            continue
        raw = bytearray(blob[start : start + expected])
        tensors[entry["name"]] = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape).clone()
    return tensors


# -- the archive ------------------------------------------------------------------------------------------------
@dataclass
class Package:
    """A package read and checked: its members (bytes), manifest, config and schema."""

    path: Path
    members: dict[str, bytes]
    manifest: dict[str, Any]
    signed_by: str | None  # the public key (hex) that signed it, when a signature is there

    @property
    def config(self) -> dict[str, Any]:
        return tomllib.loads(self.members["config.toml"].decode())

    @property
    def schema(self) -> dict[str, Any]:
        return json.loads(self.members["schema.json"])

    def weights(self) -> dict[str, torch.Tensor]:
        return decode_tensors(self.members["weights.json"], self.members["weights.bin"])


def read_package(path: str | Path, trusted_key: str | Path | None = None) -> Package:
    """The package at `path`, every member checked against the manifest; with `trusted_key` (a PEM public key
    file) its signature must verify with that key. PackageError, in one line, for anything else."""
    path = Path(path)
    if not path.is_file():
        raise PackageError(f"package {path} does not exist: give the .fastjob file `fast pack` wrote")
    try:
        with zipfile.ZipFile(path) as archive:
            members = {name: archive.read(name) for name in archive.namelist()}
    except (zipfile.BadZipFile, EOFError, OSError) as e:
        raise PackageError(f"package {path} is truncated or not a package ({e}): ask its author for it again") from None
    except zipfile.error as e:  # e.g. a CRC error: a byte changed inside the zip
        raise PackageError(f"package {path} is damaged ({e}): ask its author for it again") from None
    if MANIFEST not in members:
        raise PackageError(f"package {path} has no {MANIFEST}: it was not written by `fast pack`")
    try:
        manifest = json.loads(members[MANIFEST])
        version = int(manifest["format"])
    except (ValueError, KeyError, TypeError):
        raise PackageError(f"package {path}: its {MANIFEST} is not valid: ask its author for it again") from None
    if version > FORMAT:
        raise PackageError(f"package {path} has format {version}, newer than this FAST reads ({FORMAT}): upgrade FAST")
    listed = manifest.get("members", {})
    for name in MEMBERS:
        if name not in members or name not in listed:
            raise PackageError(f"package {path} lacks member {name}: it is incomplete; ask its author for it again")
    for name, data in members.items():
        if name in (MANIFEST, SIGNATURE):
            continue
        if listed.get(name) != sha256(data):
            what = "is not in its manifest" if name not in listed else "was altered (its SHA-256 is not the manifest's)"
            raise PackageError(f"package {path}: member {name} {what}; do not train it, ask its author for it again")
    signed_by = _check_signature(path, members, manifest, trusted_key)
    return Package(path, members, manifest, signed_by)


def _check_signature(path: Path, members: dict[str, bytes], manifest: dict[str, Any],
                     trusted_key: str | Path | None) -> str | None:  # fmt: skip
    signer, signature = manifest.get("signer"), members.get(SIGNATURE)
    if trusted_key is None:
        return signer if signature is not None else None
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
        key.verify(signature, members[MANIFEST])
    except InvalidSignature:
        why = f"its signature does not verify with {trusted_key}; do not train it"
        raise PackageError(f"package {path}: {why}") from None
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return raw.hex()
