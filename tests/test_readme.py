"""The README: its generated effects table equals the recorded demo numbers, it stays short and its links
resolve, and it shows what a person needs first."""

from __future__ import annotations

import json
import re
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _script():
    return runpy.run_path(str(ROOT / "scripts" / "effects_table.py"))


def test_effects_table_is_the_script_s_output_of_the_recorded_demo():
    script = _script()
    rows = json.loads(script["RECORDED"].read_text())
    (table,) = re.findall(r"<!-- effects:begin -->\n(.*?)\n<!-- effects:end -->", README.read_text(), re.S)
    assert table == script["effects_markdown"](rows)
    # six engine effects, four of policy staleness, the two production rollouts' shares, all significant; then the
    # sweep's three variants, and under the table the sentence naming those not significant
    sweep = [row for row in rows if row["key"] == "ratio"]
    assert len(rows) == 15 and len(sweep) == 3 and all(row["separates"] for row in rows if row not in sweep)
    sentence = table.rsplit("\n", 1)[1]
    quiet = [row["name"] for row in sweep if not row["separates"]]
    assert sentence.startswith("Of the sweep's variants") and all(name in sentence for name in quiet)
    assert not any(row["name"] in sentence for row in sweep if row["separates"])


def test_readme_opens_with_the_two_commands_ci_runs_the_test_one():
    """A newcomer's two commands come first, each doing its own set-up; CI runs the same test command."""
    first_block = README.read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    assert [line.split("#")[0].strip() for line in first_block.splitlines()] == ["make demo", "make test"]
    assert README.read_text().index("```bash") < README.read_text().index("\n## ")
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo: setup$", makefile, re.M) and re.search(r"^test: setup$", makefile, re.M)
    # CI's last stage is the README's test command, timed (`stage NAME COMMAND...` runs COMMAND as it is)
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r'^stage "[^"]+" make test$', ci, re.M) and re.search(r"^stage\(\) \{$", ci, re.M)
    assert '"$@" || code=$?' in ci  # the stage runs the command itself


def test_readme_is_short_with_start_here_first():
    text = README.read_text()
    assert len(text.splitlines()) <= 400
    start = text.split("## Start here\n", 1)[1].split("\n## ", 1)[0]
    assert len(start.strip().splitlines()) <= 20
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings.index("Contents") < headings.index("Start here") == 1 + headings.index("Contents")
    assert "--no-enable-prefix-caching" in text and "‖" in text and "Python 3.10" in text


def test_links_to_files_and_anchors_resolve():
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    anchors = {
        page: {
            re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", page.read_text(), re.M)
        }
        for page in pages
    }
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith("http"):
                continue
            path, _, anchor = target.partition("#")
            file = page if not path else (page.parent / path).resolve()
            assert file.exists(), f"{page.name}: {target}"
            if anchor and file.suffix == ".md":
                assert anchor in anchors[file], f"{page.name}: {target}"
