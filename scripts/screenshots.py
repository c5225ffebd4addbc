"""docs/report-1280.png and docs/report-800.png: the first screens of a report page at both widths, as
headless Chromium draws them (the README shows them).

python scripts/screenshots.py demo-run/moe/report/index.html
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
SHOTS = {1280: 1100, 800: 1300}  # width -> height kept: the first screen and a little more
COLOURS = 128  # a palette PNG: a page of text and flat colour keeps its look in a small file


def shoot(page: Path, width: int, height: int, out: Path) -> None:
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                f"--screenshot={out}",
                page.resolve().as_uri(),
            ],
            check=True,
            capture_output=True,
            timeout=180,
        )
    with Image.open(out) as image:
        image.convert("RGB").quantize(colors=COLOURS).save(out, optimize=True)


if __name__ == "__main__":
    page = Path(sys.argv[1])
    for width, height in SHOTS.items():
        target = ROOT / "docs" / f"report-{width}.png"
        shoot(page, width, height, target)
        print(target)
