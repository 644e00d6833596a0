"""The report's plot as a person sees it: report.html rendered by headless Chromium, then looked at.

The report is built from the reference results in ``reports/table10/results`` (a real 135M run: eight
metrics with a ratio, two of them uninformative or without one). Chromium renders ``report.html`` to a
PNG screenshot, and a second load of the same page with a small script appended reports where each panel
(``<g id="panel-...">`` of the inline SVG) and the legend landed. The test then asserts what a reader
needs: the screenshot is not blank; there is one panel per plotted metric, titled with its name; every
panel is big enough to read and none overlaps another or the legend (no legend over the lines); and in
every panel's region of the screenshot both series are visible in their colours (quantized blue,
recovered orange) next to axis ink.

Chromium comes from the system (``apt-get install -y chromium``; ``.ci/run`` installs it when missing). The
test skips, saying so, only when no Chromium binary exists.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from qrecover.reports.render import QUANTIZED_STYLE, RECOVERED_COLORS, panel_id, plotted_metrics, write_report
from qrecover.reports.results import load_results
from qrecover.reports.table import normalise

REFERENCE = Path(__file__).resolve().parents[1] / "reports" / "table10" / "results"
WIDTH = 1400
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# appended to a copy of the page: where every panel and the legend are, in page pixels, as JSON in a <pre>
PROBE = """<script>
const boxes = {};
for (const g of document.querySelectorAll('svg g[id^="panel-"], svg g#legend')) {
  const r = g.getBoundingClientRect();
  const texts = Array.from(g.querySelectorAll("text")).map(t => t.textContent.trim());
  boxes[g.id] = {x: r.left + window.scrollX, y: r.top + window.scrollY, w: r.width, h: r.height, texts: texts};
}
const pre = document.createElement("pre");
pre.id = "qr-boxes";
pre.textContent = JSON.stringify(boxes);
document.body.appendChild(pre);
</script>
"""


def chromium() -> str:
    for name in BROWSERS:
        if path := shutil.which(name):
            return path
    pytest.skip("no Chromium binary (chromium, chromium-browser, google-chrome) on PATH; install it with "
                "`apt-get install -y chromium` (.ci/run does) to check the report in a browser")


def browse(*args: str) -> subprocess.CompletedProcess:
    # --no-sandbox: Chromium refuses to start as root (containers, CI) with its sandbox
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
           "--force-device-scale-factor=1", "--no-first-run", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """(report dir, panel boxes, screenshot as an RGB PIL image)."""
    from PIL import Image

    pytest.importorskip("matplotlib")
    d = tmp_path_factory.mktemp("browser")
    runs = {p.stem: load_results(p) for p in sorted(REFERENCE.glob("eval-*.json"))}
    base = runs.pop("eval-original")
    rows = normalise(list(runs.values()), base)
    write_report(rows, base, d / "report")
    page = (d / "report" / "report.html").read_text()
    probe = d / "probe.html"
    probe.write_text(page.replace("</body>", PROBE + "</body>"))
    dom = browse(f"--window-size={WIDTH},1000", "--dump-dom", probe.as_uri()).stdout
    m = re.search(r'<pre id="qr-boxes">(.*?)</pre>', dom, re.S)
    assert m, dom[-2000:]
    boxes = json.loads(html.unescape(m.group(1)))
    height = int(max(b["y"] + b["h"] for b in boxes.values())) + 40
    shot = d / "screenshot.png"
    browse(f"--window-size={WIDTH},{height}", f"--screenshot={shot}", (d / "report" / "report.html").as_uri())
    img = Image.open(shot).convert("RGB")
    assert img.size == (WIDTH, height)
    return rows, boxes, img


def _rgb(hex_color: str) -> tuple[int, int, int]:
    return tuple(int(hex_color[i:i + 2], 16) for i in (1, 3, 5))


def count_near(img, box, color, tol=40) -> int:
    """Pixels of ``img`` inside ``box`` within ``tol`` (per channel) of ``color``."""
    x, y, w, h = (int(round(box[k])) for k in ("x", "y", "w", "h"))
    crop = np.asarray(img.crop((x, y, x + w, y + h)), dtype=np.int16)
    return int((np.abs(crop - np.array(color, dtype=np.int16)) <= tol).all(axis=-1).sum())


def overlap(a, b) -> bool:
    return a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"] and a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"]


def test_screenshot_not_blank(rendered):
    _, _, img = rendered
    colors = img.getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 100  # text, lines, markers: not one flat colour
    white = sum(n for n, c in colors if min(c) >= 250)
    assert white < 0.95 * img.size[0] * img.size[1]


def test_one_titled_panel_per_metric(rendered):
    rows, boxes, _ = rendered
    names = plotted_metrics(rows)
    assert len(names) == 8 and "gsm8k" not in names  # gsm8k: the unquantized model scores 0, no ratio to draw
    assert sorted(k for k in boxes if k != "legend") == sorted(panel_id(n) for n in names)
    for n in names:  # its title: "ifeval  (unquantized 0.167)", "mmlu: uninformative ..."
        assert any(t.split()[0].rstrip(":") == n for t in boxes[panel_id(n)]["texts"] if t), boxes[panel_id(n)]["texts"]
    assert any("uninformative" in t for t in boxes[panel_id("mmlu")]["texts"])
    assert not any("uninformative" in t for n in names if n != "mmlu" for t in boxes[panel_id(n)]["texts"])


def test_panels_readable_and_clear_of_the_legend(rendered):
    _, boxes, _ = rendered
    panels = [b for k, b in boxes.items() if k != "legend"]
    legend = boxes["legend"]
    for b in panels:
        assert b["w"] >= 220 and b["h"] >= 170, b  # big enough to read at 100% zoom
        assert not overlap(b, legend), (b, legend)
        assert b["x"] >= 0 and b["x"] + b["w"] <= WIDTH  # on the page, not cut off at the right
    for i, a in enumerate(panels):
        for b in panels[i + 1:]:
            assert not overlap(a, b), (a, b)
    assert legend["y"] + legend["h"] <= min(b["y"] for b in panels) + 1  # above the panels


def test_every_panel_shows_both_series(rendered):
    rows, boxes, img = rendered
    quantized, recovered = _rgb(QUANTIZED_STYLE["color"]), _rgb(RECOVERED_COLORS[0])
    for n in plotted_metrics(rows):
        box = boxes[panel_id(n)]
        assert count_near(img, box, quantized) >= 30, f"{n}: no quantized (blue) line visible"
        assert count_near(img, box, recovered) >= 30, f"{n}: no recovered (orange) line visible"
        assert count_near(img, box, (0, 0, 0), tol=90) >= 200, f"{n}: no axes or labels visible"
