"""`fast pack`: a training job exported into one archive that trains at a data owner's site without its source.

The model and its loss (the config's `[step]`, cross-entropy by default) are exported with torch.export on an
example batch, with a dynamic batch dimension: once in training mode (the loss) and once in evaluation mode
(the loss and the metrics: accuracy for class labels, and those of `metric`, a function of (outputs, labels)
returning named scalars). Parameters and buffers are renamed w0, w1, ... b0, ...; every node's metadata (stack
traces, source lines, module paths and class names) is dropped. The map back to the real names is written
beside the archive (`JOB.fastjob.names.json`), never inside it. What torch.export cannot capture
(data-dependent Python control flow, unsupported operators) fails here, on the author's machine, in one line.
The archive's format is fast.archive's.
"""

from __future__ import annotations

import json
import os
import re
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tomli_w
import torch
from torch import nn

from fast.archive import FORMAT, MANIFEST, SIGNATURE, encode_tensors, read_package, sha256
from fast.config import Config
from fast.errors import PackageError, first_line
from fast.factories import load_factory
from fast.jobs.code import load_data, make_model, step_of
from fast.ownership import NOT_PACKED, check_patterns
from fast.parts import UserCode, resolve
from fast.program import read_graph
from fast.version import __version__

MetricFn = Callable[[Any, torch.Tensor], dict[str, torch.Tensor]]


class Exported(nn.Module):
    """The author's model and step under neutral names: w0, w1, ... for parameters, b0, ... for buffers, called
    through torch.func.functional_call, so that no path or class of the author's reaches the graph."""

    def __init__(self, model: nn.Module, step: Callable[..., torch.Tensor], metric: MetricFn | None) -> None:
        super().__init__()
        object.__setattr__(self, "call", _Call(model, step, metric))
        self.names: dict[str, str] = {}
        for i, (name, p) in enumerate(model.named_parameters()):
            self.register_parameter(f"w{i}", nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))
            self.names[f"w{i}"] = name
        for i, (name, b) in enumerate(model.named_buffers()):
            self.register_buffer(f"b{i}", b.detach().clone())
            self.names[f"b{i}"] = name

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        tensors = {f"model.{real}": getattr(self, neutral) for neutral, real in self.names.items()}
        return torch.func.functional_call(self.call, tensors, (x, y), tie_weights=False, strict=True)


class _Call(nn.Module):
    def __init__(self, model: nn.Module, step: Callable[..., torch.Tensor], metric: MetricFn | None) -> None:
        super().__init__()
        self.model, self.step, self.metric = model, step, metric

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        loss = self.step(self.model, x, y)
        if self.model.training:
            return loss
        metrics = _metrics(self.model(x), y, self.metric)
        return (loss.detach(), *(metrics[name] for name in sorted(metrics)))


def _metrics(outputs: Any, y: torch.Tensor, metric: MetricFn | None) -> dict[str, torch.Tensor]:
    found = dict(metric(outputs, y)) if metric is not None else {}
    if isinstance(outputs, torch.Tensor) and outputs.dim() == 2 and not y.is_floating_point() and y.dim() == 1:
        found.setdefault("accuracy", (outputs.argmax(1) == y).float().mean())
    return {name: value.detach().float().reshape(()) for name, value in found.items()}


def export(module: Exported, example: tuple[torch.Tensor, torch.Tensor], training: bool) -> bytes:
    """The program's graph as JSON, every node's metadata dropped and every node checked against the operator
    allow-list; PackageError naming what cannot be exported or is not allowed."""
    from torch._export.serde.serialize import serialize

    module.train(training)
    module.call.train(training)
    batch = torch.export.Dim("batch", min=1)
    try:
        program = torch.export.export(module, example, dynamic_shapes=({0: batch}, {0: batch}), strict=False)
    except Exception as e:  # noqa: BLE001 - torch.export reports many kinds of failure
        raise PackageError(f"the model cannot be packed: torch.export failed on {type(e).__name__}: {first_line(e)}"
                           f"{_where(str(e))}") from None  # fmt: skip
    graph = json.dumps(_without_metadata(json.loads(serialize(program).exported_program))).encode()
    try:
        read_graph(graph, "the training program" if training else "the evaluation program", training=training)
    except PackageError as e:
        raise PackageError(f"the model cannot be packed: {e}") from None
    return graph


def _where(message: str) -> str:
    """ " (at FILE:LINE in FUNCTION)": the last frame of the author's own code in torch.export's message."""
    frames = [f for f in re.findall(r'File "([^"]+)", line (\d+), in (\w+)', message)
              if "site-packages" not in f[0] and "/torch/" not in f[0]]  # fmt: skip
    return f" (at {frames[-1][0]}:{frames[-1][1]} in {frames[-1][2]})" if frames else ""


def _without_metadata(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: ({} if k == "metadata" else _without_metadata(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_metadata(v) for v in value]
    return value


def _schema(example: tuple[torch.Tensor, torch.Tensor], metrics: list[str], open_keys: list[str],
            fixed_keys: list[str], derived: list[str]) -> dict[str, Any]:  # fmt: skip
    x, y = example

    def described(t: torch.Tensor) -> dict[str, Any]:
        return {"shape": list(t.shape[1:]), "dtype": str(t.dtype).removeprefix("torch.")}

    labels = "class index" if not y.is_floating_point() and y.dim() == 1 else "tensor"
    return {"input": described(x), "label": {**described(y), "kind": labels}, "metrics": metrics,
            "derived": derived, "open": open_keys, "fixed": fixed_keys}  # fmt: skip


def _example(config: Config, train: Any) -> tuple[torch.Tensor, torch.Tensor]:
    size = min(config.run.batch_size, len(train))
    samples = [train[i] for i in range(size)]
    if not all(isinstance(s, tuple | list) and len(s) == 2 for s in samples):
        raise PackageError("a packed job trains on (input, label) samples: its data must give pairs of tensors")
    return torch.stack([torch.as_tensor(s[0]) for s in samples]), torch.stack([torch.as_tensor(s[1]) for s in samples])


def pack(source: str | Path | dict[str, Any] | Config | None, out: str | Path, *, metric: str | MetricFn | None = None,
         sign: str | Path | None = None, open_keys: tuple[str, ...] = (), fixed_keys: tuple[str, ...] = (),
         model_fn: Any = None, **overrides: Any) -> Path:  # fmt: skip
    """Pack the job of `source` (a config, as `fast train` takes it) into `out`; returns the archive's path.
    `sign`: the author's ed25519 private key (PEM) to sign it with; `open_keys`: keys of the author's recipe
    (optimizer, schedule, length, batch) the data owner may set; `fixed_keys`: keys of the deployment (strategy,
    codec, workers, ...) the owner may not set (fast.ownership says whose each key is)."""
    check_patterns(tuple(open_keys), tuple(fixed_keys))
    parts = resolve(source, UserCode(model_fn=model_fn), **overrides)
    config, out = parts.config, Path(out)
    train, _ = load_data(parts.data)
    model = make_model(parts.model, train)
    step = step_of(parts.step)
    metric_fn = load_factory(metric, "--metric") if isinstance(metric, str) else metric
    example = _example(config, train)
    exported = Exported(model, step, metric_fn)
    initial = {name: t.detach().clone() for name, t in [*exported.named_parameters(), *exported.named_buffers()]}
    train_graph = export(exported, example, training=True)
    with torch.no_grad():
        exported.load_state_dict(initial)  # export may have run the model: the package starts from the initial state
    eval_graph = export(exported, example, training=False)
    model.eval()
    with torch.no_grad():
        metrics = sorted(_metrics(model(example[0]), example[1], metric_fn))
    index, blob = encode_tensors(initial)
    # perplexity = exp(mean loss) over the test set, when the job's targets ask for it (a language model)
    derived = ["perplexity"] if any(t.metric == "perplexity" for t in config.run.parsed_targets) else []
    trained = {k: v for k, v in config.to_dict().items() if k not in NOT_PACKED}
    members = {
        "config.toml": tomli_w.dumps(trained).encode(),
        "schema.json": json.dumps(
            _schema(example, metrics, list(open_keys), list(fixed_keys), derived), indent=1
        ).encode(),
        "train.json": train_graph,
        "eval.json": eval_graph,
        "weights.json": index,
        "weights.bin": blob,
    }
    write_archive(out, members, sign)
    names = {"parameters_and_buffers": exported.names, "state_dict_prefix": "program."}
    names_path(out).write_text(json.dumps(names, indent=1) + "\n")
    return out


def write_archive(out: str | Path, members: dict[str, bytes], sign: str | Path | None = None) -> Path:
    """The archive of `members` (a package's, by name) at `out`, with its manifest (their SHA-256s and sizes),
    signed with the ed25519 private key `sign` when given; written to a temporary name, then renamed."""
    manifest: dict[str, Any] = {"format": FORMAT, "fast": __version__, "torch": torch.__version__.split("+")[0],
                                "members": {name: sha256(data) for name, data in members.items()},
                                "sizes": {name: len(data) for name, data in members.items()}}  # fmt: skip
    signature = None
    if sign is not None:
        key = _private_key(sign)
        manifest["signer"] = _public_hex(key.public_key())
        signature = key.sign(json.dumps(manifest, indent=1).encode())
    members = {**members, MANIFEST: json.dumps(manifest, indent=1).encode()}
    if signature is not None:
        members[SIGNATURE] = signature
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    os.replace(tmp, out)
    return out


def names_path(package: Path) -> Path:
    """Where the author's map from neutral names back to the real ones is written: beside the package."""
    return package.with_name(package.name + ".names.json")


def _private_key(path: str | Path) -> Any:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as e:
        raise PackageError(f"signing key {path} cannot be read ({e}): give a PEM ed25519 key (fast keys)") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise PackageError(f"signing key {path} is not an ed25519 private key: make one with `fast keys`")
    return key


def _public_hex(key: Any) -> str:
    from cryptography.hazmat.primitives import serialization

    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()


def make_keys(prefix: str | Path) -> tuple[Path, Path]:
    """An ed25519 key pair: PREFIX.key (private, for `fast pack --sign`) and PREFIX.pub (for the data owner)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private, public = Path(f"{prefix}.key"), Path(f"{prefix}.pub")
    for path in (private, public):
        if path.exists():
            raise PackageError(f"{path} already exists: fast keys never overwrites a key; choose another prefix")
    private.parent.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())  # fmt: skip
    with os.fdopen(os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out:  # never readable
        out.write(pem)
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))  # fmt: skip
    return private, public


def describe(path: str | Path, trusted_key: str | Path | None = None) -> str:
    """`fast inspect`: what a package holds, checked, without training (every string from the package shown with
    its control characters escaped)."""
    package = read_package(path, trusted_key)
    schema, manifest = package.schema, package.manifest
    if package.signed_by is None:
        signer = "not signed"
    else:
        signer = f"ed25519 {package.signed_by}" + (" (verified)" if trusted_key else " (not verified: pass --trust)")
    calls = sorted({name for graph in package.graphs.values() for name in graph.operators})
    lines = [
        f"package {package.path} (format {manifest['format']}, FAST {_shown(manifest.get('fast'))}, "
        f"torch {_shown(manifest.get('torch'))}); signer: {signer}",
        f"input: {schema['input']['dtype']} {tuple(schema['input']['shape'])} per sample; "
        f"label: {schema['label']['kind']}, {schema['label']['dtype']} {tuple(schema['label']['shape'])}",
        f"metrics: {', '.join(['loss', *schema['metrics']])}",
        f"opened by the author: {', '.join(schema['open']) or 'none'}; fixed: {', '.join(schema['fixed']) or 'none'}",
        f"operators ({len(calls)}, all on the allow-list): {', '.join(calls)}",
        "members:",
        *(f"  {name:<13} {len(data):>10,} B  sha256 {sha256(data)}" for name, data in package.members.items()),
        "config:",
        *(f"  {_shown(line)}" for line in package.members["config.toml"].decode().strip().splitlines()),
    ]
    return "\n".join(lines)


def _shown(text: Any) -> str:
    """`text` as printable characters only (a package's strings must not drive the owner's terminal)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def load_trained(model: nn.Module, weights: str | Path, package: str | Path) -> nn.Module:
    """Load a packed run's model.pt into the author's own `model` (the real names from the map beside the
    package); returns the model."""
    names = json.loads(names_path(Path(package)).read_text())
    prefix = names.get("state_dict_prefix", "")
    state = torch.load(weights, weights_only=True)
    real = {names["parameters_and_buffers"][key.removeprefix(prefix)]: value for key, value in state.items()}
    model.load_state_dict(real)
    return model


__all__ = ["describe", "load_trained", "make_keys", "pack"]
