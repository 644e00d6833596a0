"""The files qrecover ships: found as package data (importlib.resources), never next to the source tree.

Checks that the default data mix and the Table-10 recipe are package resources (so a wheel install has them),
that the pipeline keys the default mix by those bytes, that a shipped recipe is named by its stem and resolves
its relative paths against the working directory, that no module reaches for files above the package
(``Path(__file__).parents[N]`` leaving ``qrecover/``), and that no document still points at the old locations.
``scripts/check_wheel.sh`` (run by CI) installs the wheel in a fresh environment and uses them from there.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
from importlib.resources import files
from pathlib import Path

import pytest
from cli_helpers import run as cli

import qrecover
from qrecover.data.mix_recipe import load_mix
from qrecover.errors import QRecoverError
from qrecover.pipeline import find_recipe, load_recipe, make_plan
from qrecover.recipes import DEFAULT_MIX, is_shipped, shipped_names, shipped_path
from qrecover.recovery.api import default_mix_path

PACKAGE = Path(qrecover.__file__).resolve().parent
REPO = PACKAGE.parent


def test_shipped_files_are_package_resources():
    res = files("qrecover.recipes")
    assert {"default-mix", "table10"} <= set(shipped_names())
    for name in ("default-mix", "table10"):
        resource = res / f"{name}.toml"
        assert resource.is_file()
        path = shipped_path(name)
        assert path.read_bytes() == resource.read_bytes()
        assert PACKAGE in path.resolve().parents  # inside the package, not the repository around it
        assert is_shipped(path)
    assert default_mix_path() == shipped_path(DEFAULT_MIX) == shipped_path("default-mix.toml")
    assert {s.name for s in load_mix(default_mix_path()).sources} == {"python-docs", "self-chat", "self-general"}


def test_pyproject_declares_the_package_data():
    import tomllib

    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "*.toml" in data["qrecover.recipes"]
    assert "*.yaml" in data["qrecover.evaluate.tasks"]


def test_unknown_shipped_name_is_refused():
    with pytest.raises(QRecoverError, match=r"'nope' is not a shipped recipe; shipped: calib-mix, default-mix, table10"):
        shipped_path("nope")
    with pytest.raises(QRecoverError, match="not a shipped recipe"):
        shipped_path("../pipeline.py")


def test_no_module_reads_files_outside_the_package():
    """Every ``Path(__file__)`` ancestor a module uses is inside ``qrecover/``: a wheel has nothing else."""
    outside = []
    for py in sorted(PACKAGE.rglob("*.py")):
        depth = len(py.relative_to(PACKAGE).parts)  # qrecover/x.py: 1; parents[depth - 1] is qrecover/
        tree = ast.parse(py.read_text())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and "__file__" in ast.unparse(node)):
                continue
            src = ast.unparse(node)
            ups = src.count(".parent") - src.count(".parents")
            m = re.search(r"\.parents\[(\d+)\]", src)
            if m:
                ups = max(ups, int(m.group(1)) + 1)
            if ups > depth:
                outside.append(f"{py.relative_to(REPO)}: {src}")
        text = py.read_text()
        for old in ("recovery/default-mix.toml", "recipes/table10.toml", '"recovery"', '"recipes"'):
            if old in text:
                outside.append(f"{py.relative_to(REPO)}: {old}")
    assert not outside, outside


def test_docs_and_scripts_name_the_new_locations():
    stale = []
    for p in [REPO / "README.md", *REPO.glob("docs/*"), *REPO.glob("benchmarks/*.py"), *REPO.glob("scripts/*"),
              *REPO.glob("reports/*.md"), *REPO.glob("tests/*.py")]:
        if p.is_file() and p.name != Path(__file__).name:
            for old in ("recovery/default-mix.toml", "recipes/table10.toml", "recovery/**"):
                if re.search(r"(?<!qrecover/)" + re.escape(old), p.read_text()):
                    stale.append(f"{p.relative_to(REPO)}: {old}")
    assert not stale, stale


def test_pipeline_keys_the_default_mix_by_its_shipped_bytes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = load_recipe("table10")
    assert recipe.source == "table10" and recipe.base_dir == tmp_path  # shipped: relative to the working dir
    assert recipe.path(recipe.work_dir) == tmp_path / "runs" / "table10"
    plan = make_plan(recipe)
    digest = hashlib.sha256(default_mix_path().read_bytes()).hexdigest()
    recovers = [s for s in plan.stages if s.kind == "recover"]
    assert recovers and all(s.config["mix"] == {"sha256": digest} for s in recovers)
    assert list(tmp_path.iterdir()) == []  # planning writes nothing


def test_recipe_path_wins_over_a_shipped_name_and_keeps_its_own_directory(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "table10").write_text('work_dir = "w"\n')
    monkeypatch.chdir(tmp_path / "sub")
    path, shipped = find_recipe("table10")
    assert (path, shipped) == (Path("table10"), False)
    assert load_recipe("table10").path("w") == (tmp_path / "sub" / "w").resolve()
    monkeypatch.chdir(tmp_path)
    assert find_recipe("table10") == (shipped_path("table10"), True)
    assert find_recipe(shipped_path("table10")) == (shipped_path("table10"), True)


def test_cli_pipeline_shipped_recipe_dry_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(["pipeline", "table10", "--dry-run", "--json"], capsys)
    assert code == 0, err
    plan = json.loads(out)
    assert plan["recipe"] == "table10" and plan["work_dir"] == str(tmp_path / "runs" / "table10")
    assert [s["name"] for s in plan["stages"]][:2] == ["eval-original", "compress-3.5bpw"]
    assert not (tmp_path / "runs").exists()
    code, _, err = cli(["pipeline", "tabel10", "--dry-run"], capsys)
    assert code == 2 and "'tabel10' does not exist and is not a shipped recipe (shipped: table10)" in " ".join(err.split())
