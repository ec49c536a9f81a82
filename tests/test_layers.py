"""The package's layers as docs/architecture.md writes them: every import points down (or stays in its
layer), and no module imports itself back through others. Read from the code (ast), so nothing is run."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


def layers() -> list[tuple[str, list[str]]]:
    """(layer, module prefixes) from the architecture table of docs/architecture.md, bottom first."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text[text.index("<!-- layers -->") : text.index("<!-- /layers -->")]
    rows = re.findall(r"^\|\s*`?([a-z]+)`?\s*\|\s*([^|]+)\|", block, flags=re.M)
    found = [(name, re.findall(r"`(fast[\w.]*)`", modules)) for name, modules in rows if name != "layer"]
    return list(reversed(found))  # the table reads top down


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """FAST modules imported anywhere in the file (function bodies and type-checking blocks included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from fast.x import y`: module fast.x.y if there is one (fast.x's __init__ runs first, as for any
            # submodule, which is no cycle), else the name y that fast.x defines or re-exports
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name == "fast" or name.startswith("fast.")}


def all_modules() -> dict[str, set[str]]:
    modules = {module_name(p): imports(p) for p in (SRC / "fast").rglob("*.py")}
    # "from fast.x import y" names module fast.x.y only when there is one
    return {m: {i for i in found if i in modules or i.rsplit(".", 1)[0] in modules} for m, found in modules.items()}


def layer_of(module: str, table: list[tuple[str, list[str]]]) -> int:
    best, index = "", -1
    for i, (_, prefixes) in enumerate(table):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, index = prefix, i
    return index


def target(name: str, modules: dict[str, set[str]]) -> str:
    return name if name in modules else name.rsplit(".", 1)[0]


def test_every_module_has_a_layer_and_imports_only_its_own_or_lower_ones():
    table, modules = layers(), all_modules()
    assert [name for name, _ in table][:2] == ["base", "config"], table
    upward = []
    for module, found in modules.items():
        if module == "fast":  # the public API: it reaches the top layers, lazily, on purpose
            continue
        mine = layer_of(module, table)
        assert mine >= 0, f"{module} is in no layer of docs/architecture.md's table"
        for name in found:
            theirs = layer_of(target(name, modules), table)
            if theirs > mine:
                upward.append(f"{module} ({table[mine][0]}) imports {name} ({table[theirs][0]})")
    assert not upward, "\n".join(sorted(upward))


def test_no_import_cycle():
    modules = all_modules()
    graph = {m: {target(n, modules) for n in found} - {m} for m, found in modules.items()}
    # a package's __init__ re-exporting its modules counts too: a module that takes a name from its own package's
    # __init__ depends on that __init__ having run to the end
    seen: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        seen[node] = 1
        stack.append(node)
        for nxt in graph.get(node, ()):
            if seen.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in seen:
                visit(nxt)
        stack.pop()
        seen[node] = 2

    for module in sorted(graph):
        if module not in seen:
            visit(module)


JOB_SECTIONS = {"data", "model", "step", "eval", "optimizer", "schedule", "strategy", "package"}
# who may read a job's sections from its config: fast.parts and fast.assemble resolve it once into the parts; a
# strategy checks its own options against them (and reads `ctx.config`, its documented view); the tools that price
# and compare configs work on configs, not on a job
READS_JOB_SECTIONS = ("fast.parts", "fast.assemble", "fast.config", "fast.strategies", "fast.pricing",
                      "fast.tools.predict", "fast.tools.comparison")  # fmt: skip


def test_below_the_parts_nobody_reads_a_jobs_sections_from_its_config_again():
    """A job is resolved once (fast.parts): the runtime, the loop and the rest receive its parts, and read only
    `[run]` (and the deployment's own tables) from the config."""
    reads = []
    for path in (SRC / "fast").rglob("*.py"):
        module = module_name(path)
        if module.startswith(READS_JOB_SECTIONS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and node.attr in JOB_SECTIONS):
                continue
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id in ("config", "cfg")) or (
                isinstance(owner, ast.Attribute) and owner.attr == "config"
            ):
                reads.append(f"{path.relative_to(ROOT)}:{node.lineno} reads `{ast.unparse(node)}`")
    assert not reads, "read the job's parts instead:\n" + "\n".join(reads)
