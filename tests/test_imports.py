"""The package's import graph: no cycles, even through imports written inside functions.

An import placed inside a function hides a cycle from the interpreter but not from the design: two modules
that need each other share something that belongs in a third, lower one (STYLE.md, 15). This test reads
every module's source (every ``import``/``from`` statement, at any depth, except under ``TYPE_CHECKING``),
builds the graph of imports between qrecover's own modules and fails on any cycle, naming it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import qrecover

PKG = Path(qrecover.__file__).parent


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
    tree = ast.parse(path.read_text())
    me = module_name(path)
    pkg = me if is_package(me) else me.rpartition(".")[0]
    skip: set[int] = set()
    for node in ast.walk(tree):  # `if TYPE_CHECKING:` blocks are not imports at run time
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for b in node.body for n in ast.walk(b)}
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
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
