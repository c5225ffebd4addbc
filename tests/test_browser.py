"""report/index.html in a real browser (headless Chromium): every plot loads, the sections come in
reading order, the metrics tables sort on a click, nothing scrolls sideways at 1280 px, and a
screenshot is taken.

The page is opened from disk, as a user would. A copy of it with one inline script appended
records, once the page has loaded, what it finds (which <img> elements failed, naturalWidth 0;
the layout; the table order before and after clicks) as attributes of <body>; Chromium's
--dump-dom prints the DOM with that record. A broken image must be caught (negative test).
The report carries every section of the metrics contract (tests/report_sections.py).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from PIL import Image
from report_sections import render_with_sections

from mismatch_probe.report.build import build_report
from mismatch_probe.testing.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = [
    pytest.mark.slow,  # a headless browser per page
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason="headless browser test needs /usr/bin/chromium (apt-get install chromium)"
    ),
]

CHECK_SCRIPT = """<script>
window.addEventListener("load", () => {
  const images = Array.from(document.images);
  const broken = images.filter((img) => !img.complete || img.naturalWidth === 0).map((img) => img.getAttribute("src"));
  document.body.setAttribute("data-images", String(images.length));
  document.body.setAttribute("data-broken", broken.join(" ") || "none");
});
</script>"""


def chromium(profile: Path, *args: str) -> str:
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--hide-scrollbars",
    ]
    result = subprocess.run([str(CHROMIUM), *flags, *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


LAYOUT_SCRIPT = """<script>
window.addEventListener("load", () => {
  const body = document.body;
  const record = (name, value) => body.setAttribute("data-" + name, String(value));
  record("sections", Array.from(document.querySelectorAll("body > section")).map((s) => s.id).join(" "));
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


def page_check(report: Path, profile: Path, script: str, width: int = 1280) -> dict[str, str]:
    """The data-* attributes that `script`, appended to report/index.html, left on <body>."""
    html = (report / "index.html").read_text()
    probe = report / "index-check.html"  # same folder, so relative image paths resolve as in index.html
    probe.write_text(html.replace("</body>", script + "</body>"))
    dom = chromium(profile, f"--window-size={width},1600", "--virtual-time-budget=10000", "--dump-dom", probe.as_uri())
    body = re.search(r"<body([^>]*)>", dom)
    record = dict(re.findall(r'data-([a-z0-9-]+)="([^"]*)"', body.group(1))) if body else {}
    assert record, f"the check script did not run: {dom[:500]}"
    return record


def image_check(report: Path, profile: Path) -> tuple[int, str]:
    """(number of <img>, space-separated srcs that failed to load or "none") for report/index.html."""
    record = page_check(report, profile, CHECK_SCRIPT)
    return int(record["images"]), record["broken"]


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


def test_every_plot_loads_and_page_renders(report_dir, tmp_path):
    pngs = sorted(p.name for p in report_dir.glob("*.png"))
    count, broken = image_check(report_dir, tmp_path / "profile")
    assert (count, broken) == (len(pngs), "none")
    shot = tmp_path / "report.png"
    chromium(
        tmp_path / "profile", "--window-size=1280,4000", f"--screenshot={shot}", (report_dir / "index.html").as_uri()
    )
    with Image.open(shot) as image:
        assert image.size == (1280, 4000)
        # A rendered report is not a blank page: it has many distinct colours (text, tables, plots).
        assert len(image.convert("RGB").getcolors(maxcolors=1 << 20) or []) > 500
    if os.environ.get("PROBE_SCREENSHOT"):  # for a person to look at the page
        shutil.copy(shot, os.environ["PROBE_SCREENSHOT"])


def test_missing_image_is_detected(report_dir, tmp_path):
    report = shutil.copytree(report_dir, tmp_path / "report")
    (report / "extreme_fraction.png").unlink()
    index = report / "index.html"
    index.write_text(index.read_text().replace('src="routing_token.png"', 'src="no-such-plot.png"'))
    count, broken = image_check(report, tmp_path / "profile")
    assert count == len(list(report_dir.glob("*.png")))
    assert sorted(broken.split()) == ["extreme_fraction.png", "no-such-plot.png"]


def test_reading_order_sorting_folding_and_width(report_dir, tmp_path):
    record = page_check(report_dir, tmp_path / "profile", LAYOUT_SCRIPT)
    assert record["sections"] == "findings comparisons together metrics run"  # findings first, manifests last
    assert record["cards"] == "2"  # one card per comparison
    assert (record["run-details"], record["open-details"]) == ("3", "0")  # each manifest folded
    assert int(record["overflow"]) <= 0  # no sideways scrolling at 1280 px
    before = [float(v) for v in record["k3-before"].split()]
    assert [float(v) for v in record["k3-ascending"].split()] == sorted(before)
    assert [float(v) for v in record["k3-descending"].split()] == sorted(before, reverse=True)
    assert before != sorted(before)  # the click changed the order (bf16's k3 is above r3's)
    assert record["k3-aria"] == "descending"
