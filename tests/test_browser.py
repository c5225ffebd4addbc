"""report/index.html in a real browser (headless Chromium), at 1280 and 800 px: the page is one file (it
renders alone, figures inline), the sections come in reading order, the verdict and summary table fit the
first screen, nothing scrolls sideways, figure text reads at 11 px or more, and the metrics tables sort
on a click. A screenshot is taken.

The page is opened from disk, as a user would. A copy of it with one inline script appended records what
it finds as attributes of <body>; Chromium's --dump-dom prints the DOM with that record (tests/browser.py).
The report carries every section of the metrics contract (tests/report_sections.py).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from browser import CHROMIUM, VIEWPORT_HEIGHT, chromium, layout, page_check
from PIL import Image
from report_sections import render_with_sections

from mismatch_probe.report.build import build_report
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

pytestmark = [
    pytest.mark.slow,  # a headless browser per page
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason="headless browser test needs /usr/bin/chromium (apt-get install chromium)"
    ),
]
MIN_TEXT_PX = 11

SORTING_SCRIPT = """<script>
window.addEventListener("load", () => {
  const body = document.body;
  const record = (name, value) => body.setAttribute("data-" + name, String(value));
  record("sections", Array.from(document.querySelectorAll("body > section")).map((s) => s.id).join(" "));
  record("images", document.querySelectorAll("img").length);
  record("svgs", document.querySelectorAll("svg").length);
  record("cards", document.querySelectorAll("section.card").length);
  record("run-details", document.querySelectorAll("#run details").length);
  record("open-details", document.querySelectorAll("#run details[open]").length);
  record("overflow", document.documentElement.scrollWidth - window.innerWidth);
  const table = document.querySelector("table.sortable");
  const header = Array.from(table.tHead.rows[0].cells);
  const column = header.findIndex((th) => th.textContent === "k3_kl");
  const order = () => Array.from(table.tBodies[0].rows).map((row) => row.cells[column].dataset.sort).join(" ");
  record("k3-before", order());
  header[column].click();
  record("k3-ascending", order());
  header[column].click();
  record("k3-descending", order());
  record("k3-aria", header[column].getAttribute("aria-sort"));
});
</script>"""


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory) -> Path:
    spec = SyntheticSpec(
        n_samples=40,
        prompt_len=(4, 12),
        response_len=(20, 80),
        score_sets=(
            ScoreSetSpec("bf16", logprob_sigma=0.2, route_fraction=0.05),
            ScoreSetSpec("r3", route_fraction=0.0),
        ),
    )
    root = write_synthetic_run(tmp_path_factory.mktemp("browser") / "run", spec)
    directory = build_report(root).directory
    render_with_sections(root)
    return directory


def test_page_renders_alone(report_dir, tmp_path):
    """index.html copied alone into an empty folder (a CI artifact, a chat attachment) shows every figure."""
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(report_dir / "index.html", alone / "index.html")
    record = page_check(alone / "index.html", tmp_path / "profile", SORTING_SCRIPT)
    assert record["images"] == "0" and int(record["svgs"]) >= 5
    shot = tmp_path / "report.png"
    chromium(tmp_path / "profile", "--window-size=1280,4000", f"--screenshot={shot}", (alone / "index.html").as_uri())
    with Image.open(shot) as image:
        assert image.size == (1280, 4000)
        # A rendered report is not a blank page: it has many distinct colours (text, tables, plots).
        assert len(image.convert("RGB").getcolors(maxcolors=1 << 20) or []) > 500
    if os.environ.get("PROBE_SCREENSHOT"):  # for a person to look at the page
        shutil.copy(shot, os.environ["PROBE_SCREENSHOT"])


@pytest.mark.parametrize("width", [1280, 800])
def test_first_screen_width_and_text_size(report_dir, tmp_path, width):
    measured = layout(report_dir / "index.html", tmp_path / "profile", width)
    assert 0 < measured["summary-bottom"] <= VIEWPORT_HEIGHT  # verdict and summary table on the first screen
    assert measured["overflow"] <= 0  # no sideways scrolling, every <details> open
    assert measured["smallest-font"] >= MIN_TEXT_PX, measured["smallest-text"]
    assert measured["height"] <= 10_000


def test_reading_order_sorting_folding_and_width(report_dir, tmp_path):
    record = page_check(report_dir / "index.html", tmp_path / "profile", SORTING_SCRIPT)
    # the verdict first, manifests last
    assert record["sections"] == "verdict next findings comparisons together metrics run"
    assert record["cards"] == "2"  # one card per comparison
    assert (record["run-details"], record["open-details"]) == ("4", "0")  # the sides and each manifest folded
    assert int(record["overflow"]) <= 0  # no sideways scrolling at 1280 px
    before = [float(v) for v in record["k3-before"].split()]
    assert [float(v) for v in record["k3-ascending"].split()] == sorted(before)
    assert [float(v) for v in record["k3-descending"].split()] == sorted(before, reverse=True)
    assert before != sorted(before)  # the click changed the order (bf16's k3 is above r3's)
    assert record["k3-aria"] == "descending"


@pytest.fixture(scope="module")
def steps_report_dir(tmp_path_factory) -> Path:
    """A Recorder run of 40 steps whose k3 jumps about 5x at step 23: the timeline and its small multiples."""
    import numpy as np

    from mismatch_probe.record import Recorder

    rng = np.random.default_rng(0)
    root = tmp_path_factory.mktemp("steps") / "run"
    with Recorder(root, num_experts=8) as rec:
        for step in range(40):
            for _ in range(6):
                inference = -rng.random(30).astype(np.float32) - 0.5
                training = inference + (0.05 if step < 23 else 0.11) * rng.standard_normal(30).astype(np.float32)
                experts = rng.integers(0, 8, (34, 2, 2))
                rec.add(rng.integers(0, 100, 5), rng.integers(0, 100, 30), inference, training, experts, step=step)
    return build_report(root).directory


@pytest.mark.parametrize("width", [1280, 800])
def test_timeline_page_text_size_and_width(steps_report_dir, tmp_path, width):
    page = steps_report_dir / "index.html"
    assert '<section id="steps">' in page.read_text()
    measured = layout(page, tmp_path / "profile", width)
    assert measured["overflow"] <= 0
    assert measured["smallest-font"] >= MIN_TEXT_PX, measured["smallest-text"]
