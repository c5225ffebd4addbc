"""report/index.html in a real browser (headless Chromium): every plot loads, and a screenshot is taken.

The page is opened from disk, as a user would. A copy of it with one inline script appended
records, once the page has loaded, which <img> elements failed (naturalWidth 0); Chromium's
--dump-dom prints the DOM with that record. A broken image must be caught (negative test).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from PIL import Image

from mismatch_probe.report import build_report
from mismatch_probe.synthetic import ScoreSetSpec, SyntheticSpec, write_synthetic_run

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="headless browser test needs /usr/bin/chromium (apt-get install chromium)"
)

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
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={profile}", "--hide-scrollbars",
    ]  # fmt: skip
    result = subprocess.run([str(CHROMIUM), *flags, *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def image_check(report: Path, profile: Path) -> tuple[int, str]:
    """(number of <img>, space-separated srcs that failed to load or "none") for report/index.html."""
    html = (report / "index.html").read_text()
    probe = report / "index-check.html"  # same folder, so relative image paths resolve as in index.html
    probe.write_text(html.replace("</body>", CHECK_SCRIPT + "</body>"))
    dom = chromium(profile, "--virtual-time-budget=10000", "--dump-dom", probe.as_uri())
    match = re.search(r'<body[^>]*data-images="(\d+)"[^>]*data-broken="([^"]*)"', dom)
    assert match, f"the check script did not run: {dom[:500]}"
    return int(match.group(1)), match.group(2)


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory) -> Path:
    spec = SyntheticSpec(
        n_samples=40, prompt_len=(4, 12), response_len=(20, 80),
        score_sets=(ScoreSetSpec("bf16", logprob_sigma=0.2, route_fraction=0.05), ScoreSetSpec("r3", route_fraction=0.0)),
    )  # fmt: skip
    root = write_synthetic_run(tmp_path_factory.mktemp("browser") / "run", spec)
    return build_report(root).directory


def test_every_plot_loads_and_page_renders(report_dir, tmp_path):
    pngs = sorted(p.name for p in report_dir.glob("*.png"))
    count, broken = image_check(report_dir, tmp_path / "profile")
    assert (count, broken) == (len(pngs), "none")
    shot = tmp_path / "report.png"
    chromium(tmp_path / "profile", "--window-size=1280,2400", f"--screenshot={shot}", (report_dir / "index.html").as_uri())
    with Image.open(shot) as image:
        assert image.size == (1280, 2400)
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
