"""The package's import graph: its paths run one way, bottom to top, with no cycles.

An import placed inside a function, or under ``TYPE_CHECKING``, hides a cycle from the interpreter but not
from the design: two modules that need each other share something that belongs in a third, lower one
(STYLE.md, 15). This test reads every module's source (every ``import``/``from`` statement, at any depth,
``TYPE_CHECKING`` blocks included), builds the graph of imports between qrecover's own modules, and fails on
any cycle and on any import of a module in a higher layer than the importer's (:data:`LAYERS`), naming the
module, the import and both layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import qrecover

PKG = Path(qrecover.__file__).parent

#: The layers, bottom to top (docs: ARCHITECTURE.md, "Layout: layers, bottom to top"); a module may import its
#: own layer and the layers below it, never one above. A module belongs to the layer of the longest name listed
#: here that is the module itself or a package holding it; a new module inside a listed package fits in by
#: itself, a new top-level module needs a line here (the test names it).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("leaves", ("qrecover._version", "qrecover.errors", "qrecover.fields", "qrecover.registry", "qrecover.packing",
                "qrecover.io_utils", "qrecover.progress", "qrecover.measure", "qrecover.config", "qrecover.benchdata",
                "qrecover.recipes", "qrecover.distributed", "qrecover.hardware")),
    # reports.results is the results file format (written by evaluate, read by reports), as checkpoint is the manifest's
    ("formats", ("qrecover.schemes", "qrecover.qlinear", "qrecover.kernels", "qrecover.checkpoint", "qrecover.moe",
                 "qrecover.reports.results")),
    ("models", ("qrecover.models",)),
    ("data", ("qrecover.data",)),
    # loading (a checkpoint, with its adapter) sits on the adapters: PEFT integration is how an adapter loads
    ("algorithms", ("qrecover.transforms", "qrecover.calibrate", "qrecover.grad_pass", "qrecover.sensitivity", "qrecover.allocate",
                    "qrecover.allocate_solver",
                    "qrecover.adapters", "qrecover.loading")),
    ("stages", ("qrecover.stages", "qrecover.recovery", "qrecover.evaluate")),
    ("outputs", ("qrecover.reports", "qrecover.export")),
    # the package itself is the public facade (qrecover.load, qrecover.compress, ... imported on first use)
    ("entry", ("qrecover", "qrecover.api", "qrecover.pipeline", "qrecover.cli")),
]

#: Upward imports that are known and being removed, ``(importer, imported): why``. An entry whose import is
#: gone fails the test too, so the list only shrinks.
PENDING: dict[tuple[str, str], str] = {
}


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def is_package(name: str) -> bool:
    return (PKG.parent / Path(*name.split(".")) / "__init__.py").exists()


def known(name: str) -> str | None:
    """``name`` if it is one of qrecover's modules, else its longest importable prefix within qrecover."""
    parts = name.split(".")
    while parts:
        cand = ".".join(parts)
        base = PKG.parent / Path(*parts)
        if base.with_suffix(".py").exists() or (base / "__init__.py").exists():
            return cand
        parts.pop()
    return None


def imports_of(path: Path) -> set[str]:
    return imports_in(path.read_text(), module_name(path))


def imports_in(source: str, me: str) -> set[str]:
    """The qrecover modules that the source of module ``me`` imports (any depth, TYPE_CHECKING included)."""
    tree = ast.parse(source)
    pkg = me if is_package(me) else me.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):  # `if TYPE_CHECKING:` blocks too: a type-only import is still a dependency
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                root = ".".join(base + ([node.module] if node.module else []))
            else:
                root = node.module or ""
            # `from . import x` imports the submodule x; `from .m import f` imports m
            names = [f"{root}.{a.name}" if known(f"{root}.{a.name}") == f"{root}.{a.name}" else root for a in node.names]
        else:
            continue
        for n in names:
            if n.split(".")[0] == "qrecover" and (k := known(n)) and k != me:
                out.add(k)
    return out


def graph() -> dict[str, set[str]]:
    # (a submodule's implicit import of its parent package is left out: a package's __init__ importing its
    # submodules, which import each other, is the ordinary layout, not a cycle)
    return {module_name(p): imports_of(p) for p in PKG.rglob("*.py")}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(g.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if state.get(m) is None and (c := visit(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(g):
        if state.get(n) is None and (c := visit(n)):
            return c
    return None


def layer_of(module: str) -> tuple[int, str] | None:
    """``(index, name)`` of ``module``'s layer in :data:`LAYERS` (longest listed prefix), or None if unlisted."""
    best: tuple[int, int, str] | None = None
    for i, (layer, names) in enumerate(LAYERS):
        for n in names:
            fits = module == n or (n != "qrecover" and module.startswith(n + "."))
            if fits and (best is None or len(n) > best[0]):
                best = (len(n), i, layer)
    return None if best is None else (best[1], best[2])


def upward_imports(g: dict[str, set[str]]) -> list[str]:
    """One line per import of a module in a higher layer than its importer's."""
    out = []
    for mod in sorted(g):
        lo = layer_of(mod)
        for dep in sorted(g[mod]):
            hi = layer_of(dep)
            if lo is not None and hi is not None and hi[0] > lo[0]:
                out.append(f"{mod} (layer {lo[0] + 1} {lo[1]}) imports {dep} (layer {hi[0] + 1} {hi[1]})")
    return out


def test_every_module_is_in_a_layer():
    unlisted = sorted(m for m in graph() if layer_of(m) is None)
    assert not unlisted, f"modules in no layer: {unlisted}; add each to LAYERS in tests/test_imports.py"


def test_imports_run_down_the_layers():
    g = graph()
    gone = [k for k in PENDING if k[1] not in g.get(k[0], set())]
    assert not gone, f"PENDING lists imports that are gone: {gone}; remove them from tests/test_imports.py"
    new = [line for line in upward_imports(g) if not any(line.startswith(f"{a} (") and f" imports {b} (" in line for a, b in PENDING)]
    assert not new, "upward imports (a module may import only its own layer and those below):\n" + "\n".join(new)


def test_layer_check_finds_a_planted_upward_import():
    """The check names the module, the import and both layers, and a TYPE_CHECKING import counts."""
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..api import compress\n"
    g = {"qrecover.data.source": imports_in(typed, "qrecover.data.source"), "qrecover.api": {"qrecover.errors"}}
    assert g["qrecover.data.source"] == {"qrecover.api"}
    assert upward_imports(g) == ["qrecover.data.source (layer 4 data) imports qrecover.api (layer 8 entry)"]
    assert layer_of("qrecover.data.mix") == (3, "data") and layer_of("qrecover") == (7, "entry")
    assert layer_of("qrecover.adapters.svd_init") == (4, "algorithms") and layer_of("qrecover.nowhere") is None
    assert layer_of("qrecover.reports.results") == (1, "formats") and layer_of("qrecover.reports.table") == (6, "outputs")


def test_graph_is_read():
    g = graph()
    assert "qrecover.api" in g and "qrecover.models" in g["qrecover.api"]
    assert "qrecover.data.mix" in g and "qrecover.errors" in g["qrecover.data.mix"]


def test_no_import_cycles():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_planted_cycle():
    g = {"qrecover.a": {"qrecover.b"}, "qrecover.b": {"qrecover.c"}, "qrecover.c": {"qrecover.a"}, "qrecover.d": set()}
    assert find_cycle(g) == ["qrecover.a", "qrecover.b", "qrecover.c", "qrecover.a"]
    assert find_cycle({"qrecover.a": {"qrecover.b"}, "qrecover.b": set()}) is None


def test_configs_round_trip_and_refuse_unknown_keys():
    """One to/from-dict implementation (qrecover.fields.DictConfig) serves every config: a dict round trip is
    the identity and an unknown key is named in the error."""
    import pytest

    from qrecover.config import CompressConfig
    from qrecover.errors import QRecoverError
    from qrecover.recovery.config import RecoverConfig

    for cls, change, what in ((CompressConfig, {"bpw": 3.5, "bits": [2, 4]}, "compress config"),
                              (RecoverConfig, {"rank": 8, "lr": 1e-3}, "recover config")):
        cfg = cls.from_dict({**cls().to_dict(), **change})
        assert cls.from_dict(cfg.to_dict()) == cfg and all(getattr(cfg, k) == v for k, v in change.items())
        with pytest.raises(QRecoverError, match=rf"unknown {what} key\(s\) \['bogus'\]"):
            cls.from_dict({"bogus": 1})
