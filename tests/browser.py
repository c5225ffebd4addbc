"""Headless Chromium for the page tests: open a page from disk with one inline script appended, and read back
what the script recorded as data-* attributes of <body> (Chromium's --dump-dom prints the DOM after load)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
VIEWPORT_HEIGHT = 900  # the first screen: the verdict and the summary table must fit in it

# What a reader at this width sees: page height, sideways scroll (with every <details> open, the widest
# state), where the summary table ends, and the smallest figure text as rendered (SVG font size times
# the SVG's scale on the page).
LAYOUT_SCRIPT = """<script>
window.addEventListener("load", () => {
  const body = document.body, record = (name, value) => body.setAttribute("data-" + name, String(value));
  record("height", document.documentElement.scrollHeight);
  const summary = document.querySelector("table.summary");
  record("summary-bottom", summary ? summary.getBoundingClientRect().bottom + window.scrollY : -1);
  document.querySelectorAll("details").forEach((d) => d.setAttribute("open", ""));
  record("overflow", document.documentElement.scrollWidth - window.innerWidth);
  let smallest = Infinity, smallestText = "";
  document.querySelectorAll("svg").forEach((svg) => {
    const box = svg.viewBox.baseVal, width = svg.getBoundingClientRect().width;
    if (!box || !box.width || !width) return;
    svg.querySelectorAll("text").forEach((text) => {
      const px = parseFloat(getComputedStyle(text).fontSize) * width / box.width;
      if (px < smallest) { smallest = px; smallestText = text.textContent; }
    });
  });
  record("smallest-font", smallest === Infinity ? -1 : smallest.toFixed(2));
  record("smallest-text", smallestText.slice(0, 40));
  record("svgs", document.querySelectorAll("svg").length);
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
    result = subprocess.run([str(CHROMIUM), *flags, *args], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def page_check(page: Path, profile: Path, script: str, width: int = 1280) -> dict[str, str]:
    """The data-* attributes that `script`, appended to the page, left on <body>."""
    probe = page.with_name(f".check-{page.name}")  # same folder, as the page would be opened
    probe.write_text(page.read_text().replace("</body>", script + "</body>"))
    try:
        dom = chromium(
            profile,
            f"--window-size={width},{VIEWPORT_HEIGHT}",
            "--virtual-time-budget=10000",
            "--dump-dom",
            probe.as_uri(),
        )
    finally:
        probe.unlink()
    body = re.search(r"<body([^>]*)>", dom)
    record = dict(re.findall(r'data-([a-z0-9-]+)="([^"]*)"', body.group(1))) if body else {}
    assert record, f"the check script did not run: {dom[:500]}"
    return record


def layout(page: Path, profile: Path, width: int) -> dict[str, float]:
    record = page_check(page, profile, LAYOUT_SCRIPT, width)
    return {key: float(value) for key, value in record.items() if key != "smallest-text"} | {
        "smallest-text": record["smallest-text"]
    }
