"""benchmarks/calib_noise.py's parts that decide what its table means: the calibration draws are disjoint, come from
the Python docs' train split only (never the eval split the python-docs column scores, nor the shipped calib split),
and each draw's files all fall in a text source's calib split; the paired summary compares the same draw."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.calib_noise import make_draws, summary  # noqa: E402
from qrecover.data.corpus import PYTHON_DOCS, SPLITS, _bucket, documents, source_files  # noqa: E402


@pytest.mark.skipif(not PYTHON_DOCS.is_dir(), reason="the Python docs (python3.11-doc) are not installed")
def test_draws_are_disjoint_train_documents_that_all_land_in_the_calib_split(tmp_path):
    stale = tmp_path / ".draw1.partial"  # an interrupted run's half-built draw is rebuilt, not reused
    stale.mkdir()
    (stale / "stale.txt").write_text("not a train document")
    sources = make_draws(tmp_path, 4)
    assert sources[0] == "python-docs" and len(sources) == 4
    train = {f.resolve() for f in source_files("python-docs")[1]
             if _bucket(str(f.relative_to(PYTHON_DOCS)))[0] in SPLITS["train"]}
    seen: set[Path] = set()
    for src in sources[1:]:
        files = sorted(Path(src).iterdir())
        targets = {f.resolve() for f in files}
        assert targets <= train and not targets & seen, "a draw holds a file outside the train split or another draw's"
        seen |= targets
        assert len(documents(src, "calib")) == len([f for f in files if f.read_text(errors="replace").strip()])
    assert seen == train  # every train document in exactly one draw
    assert make_draws(tmp_path, 4) == sources  # reused, not rebuilt
    assert not list(tmp_path.glob(".draw*"))


def test_summary_pairs_each_draw_with_the_same_draw_of_the_first_configuration():
    def row(config, draw, docs, worst_domain):
        return {"config": config, "draw": draw, "wall_s": 1.0,
                "ratio": {"python-docs": docs, "a": worst_domain, "b": 1.0}}
    rows = [row("base", 0, 1.10, 1.30), row("base", 1, 1.20, 1.50),
            row("new", 0, 1.12, 1.20), row("new", 1, 1.26, 1.60)]
    lines = summary(rows, ["base", "new"], ["a", "b"])
    paired = next(line for line in lines if line.startswith("| new | +"))
    # python-docs: +0.02 and +0.06 -> +0.040, worse on both; worst: -0.10 and +0.10 -> +0.000, worse on one
    assert paired == "| new | +0.040 (worse 2/2) | +0.000 (worse 1/2) | +0.000 (worse 0/2) | +0.000 (worse 1/2) |"
    base = next(line for line in lines if line.startswith("| base | 2 |"))
    assert "1.400 ± 0.141 (1.300-1.500)" in base
