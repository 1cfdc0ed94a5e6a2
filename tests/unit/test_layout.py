"""The layout tells the architecture: the walls between the parts, checked on every import.

- ``topics/`` (the contract) imports none of the other parts;
- ``batcher/`` imports no I/O (no aiokafka, redis, asyncio, torch): decisions over plain data;
- ``producers/`` and ``consumers/`` meet only through ``topics/``;
- no part imports ``ops/``; within ``ops/``, runtime code (``control``, ``deploy``, ``capacity``)
  imports no development tooling (``localstack``, ``bench``, ``cli``);
- no module imports another's private name (``_x``): what is shared is public;
- ``ops/`` keeps its modules in role subpackages.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests import ROOT

PARTS = ("topics", "batcher", "producers", "consumers", "ops")
IO_LIBRARIES = ("aiokafka", "redis", "asyncio", "torch", "socket", "subprocess", "faust")
RUNTIME_OPS = ("control", "deploy", "capacity")
DEV_OPS = ("localstack", "bench", "cli", "demo")
OPS_TOP_LEVEL_MODULES = 4


def modules(part: str) -> Iterator[tuple[str, Path]]:
    """(dotted name, path) of every module of ``part``: ``kinfer.<part>...``, or ``tests...``."""
    for path in sorted((ROOT / part).rglob("*.py")):
        dotted = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        yield (dotted if part == "tests" else f"kinfer.{dotted}"), path


def imports(path: Path) -> Iterator[tuple[int, str, list[str]]]:
    """(line, module, names) of every import in ``path``, relative ones resolved."""
    package = "kinfer." + ".".join(path.relative_to(ROOT).parent.parts)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            yield node.lineno, base, [a.name for a in node.names]


def within(module: str, names: tuple[str, ...]) -> bool:
    return any(module == name or module.startswith(name + ".") for name in names)


def violations(part: str, forbidden: tuple[str, ...], where: tuple[str, ...] = ()) -> list[str]:
    """Imports by ``part``'s modules (those under ``where`` if given) of anything in ``forbidden``: a
    library name (``torch``) or a part of kinfer (``ops``, ``ops.bench``)."""
    forbidden = (*forbidden, *(f"kinfer.{f}" for f in forbidden))
    found = []
    for dotted, path in modules(part):
        if where and not within(dotted, tuple(f"kinfer.{part}.{w}" for w in where)):
            continue
        for line, module, _ in imports(path):
            if within(module, forbidden):
                found.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return found


def test_the_contract_imports_no_other_part() -> None:
    assert violations("topics", ("batcher", "producers", "consumers", "ops")) == []


def test_the_batcher_is_pure() -> None:
    assert violations("batcher", ("topics", "producers", "consumers", "ops", *IO_LIBRARIES)) == []


def test_producers_and_consumers_meet_only_through_the_contract() -> None:
    assert violations("producers", ("consumers", "ops")) == []
    assert violations("consumers", ("producers", "ops")) == []


def test_runtime_operations_import_no_development_tooling() -> None:
    dev = tuple(f"ops.{d}" for d in DEV_OPS)
    assert violations("ops", dev, where=RUNTIME_OPS) == []


def test_no_private_name_is_imported_across_modules() -> None:
    found = []
    for part in (*PARTS, "tests"):
        for _, path in modules(part):
            for line, module, names in imports(path):
                private = [n for n in names if n.startswith("_") and not n.startswith("__")]
                if private and module != "__future__":
                    found.append(f"{path.relative_to(ROOT)}:{line} takes {', '.join(private)} from {module}")
    assert found == []


def test_ops_keeps_its_modules_in_role_subpackages() -> None:
    top = sorted(p.name for p in (ROOT / "ops").glob("*.py"))
    assert len(top) <= OPS_TOP_LEVEL_MODULES, top
    roles = sorted(p.name for p in (ROOT / "ops").iterdir() if (p / "__init__.py").exists())
    assert roles == sorted(("bench", "capacity", "cli", "control", "deploy", "localstack"))


def test_the_checker_sees_a_wall_broken() -> None:
    """The walls above are not vacuous: a module that breaks one is found."""
    tree = ast.parse("from kinfer.ops.localstack.stack import StackInfo\nfrom kinfer.topics.names import _x\n")
    nodes = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert [n.module for n in nodes] == ["kinfer.ops.localstack.stack", "kinfer.topics.names"]
    assert sum(1 for _ in modules("ops")) > 30 and any(m == "kinfer.ops.control.lagmon" for m, _ in modules("ops"))
    lagmon = ROOT / "ops" / "control" / "lagmon.py"
    assert any(module == "kinfer.topics.readers" for _, module, _ in imports(lagmon))
    bench = ("kinfer.ops.bench",)
    assert within("kinfer.ops.bench.faults", bench) and not within("kinfer.ops.benchmarks", bench)
