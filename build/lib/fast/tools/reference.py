"""`fast reference`: the configuration reference of strategies and codecs, read from their own declarations (the
README's tables are this; tests/test_reference.py keeps them equal)."""

from __future__ import annotations

import inspect

from fast.codecs import CODECS, build_codec, codec_options
from fast.strategies import registry, variant
from fast.strategies.base import StrategyOptions


def _first_line(obj: object) -> str:
    doc = inspect.getdoc(obj) or inspect.getdoc(inspect.getmodule(obj)) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def strategy_rows() -> list[tuple[str, str, str, str, str]]:
    """(name, what it is, its keys with defaults, the codecs it can use, when it takes a change of live
    membership) for every strategy FAST ships."""
    rows = []
    common = set(StrategyOptions.model_fields)
    built_in = {name: cls for name, cls in registry().items() if cls.__module__.startswith("fast.")}
    for name, cls in sorted(built_in.items()):
        keys = []
        for key, field in cls.Options.model_fields.items():
            if key in common:
                continue
            default = "required" if field.is_required() else repr(field.default)
            text = f"`{key}` = {default}"
            keys.append(f"{text}: {field.description}" if field.description else text)
        what = (
            _first_line(inspect.getmodule(cls)).split(":", 1)[-1].strip()
            if name != "none"
            else ("no communication at all: every worker trains alone (the upper bound of speed)")
        )
        variants = [variant(cls, {}, name) for name in CODECS]  # gossip's codecs belong to CHOCO-SGD, say
        usable = [
            name for name, runner in zip(CODECS, variants, strict=True) if runner.accepts_codec(build_codec(name))
        ]
        codecs = "all" if usable == list(CODECS) else ", ".join(usable)
        rows.append((name, what, "; ".join(keys) or "—", codecs, cls.joins_when if cls.joins else "no"))
    return rows


def codec_rows() -> list[tuple[str, str]]:
    from fast.codecs import _CLASSES

    rows = []
    for name in CODECS:
        parameters = inspect.signature(_CLASSES[name].__init__).parameters
        keys = []
        for option in codec_options(name):
            p = parameters.get(option)
            default = "" if p is None or p.default is inspect.Parameter.empty else f" = {p.default!r}"
            keys.append(f"`{option}`{default}")
        rows.append((name, ", ".join(keys)))
    return rows


def markdown() -> str:
    lines = ["| strategy | what it does | keys (default) | codecs | joins and leaves (`run.elastic`) |",
             "|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| `{n}` | {w} | {k} | {c} | {j} |" for n, w, k, c, j in strategy_rows()]
    lines += ["", "| codec | keys (default) |", "|---|---|"]
    lines += [f"| `{n}` | {k} |" for n, k in codec_rows()]
    return "\n".join(lines)
