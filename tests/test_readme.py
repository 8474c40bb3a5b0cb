"""The README is a page (issue 39): what trl_ext is and how to use it, at most 450 lines, with the two fresh-machine
commands CI runs; measurements, long tables and history live in docs/ and CHANGELOG.md, and every link between
them resolves (a file that exists, a heading that exists in it)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_LINES = 450
MAIN_JOB = "uv run accelerate launch --config_file accelerate_configs/single_process.yaml recipes/grpo_math.py"
PAGES = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]


def _prose(text: str) -> str:
    """The text outside fenced code blocks (a ``# comment`` in a bash block is no heading)."""
    return re.sub(r"(?ms)^```.*?^```", "", text)


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {github_anchor(m.group(1)) for m in re.finditer(r"(?m)^#{1,6} (.+)$", _prose(path.read_text()))}


def test_the_readme_fits_a_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/"


def test_the_readme_keeps_the_two_commands_ci_runs():
    """The install line, the main job and the test command, as written in the fresh-machine block; .ci/run runs the
    same test command and lint commands the README names."""
    readme = README.read_text()
    block = readme[readme.index("## Two commands on a fresh machine") :]
    block = block[block.index("```bash") : block.index("```\n", block.index("```bash") + 7)]
    commands = [line.split("#")[0].strip() for line in block.splitlines()[1:]]
    assert commands == ["uv sync --compile-bytecode", MAIN_JOB, "uv run pytest"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "\nuv run pytest\n" in ci
    assert "`uv run ruff check . && uv run ruff format --check .`" in readme
    assert "uv run ruff check .\n" in ci and "uv run ruff format --check .\n" in ci


def test_github_anchor():
    assert github_anchor("Installing trl_ext into another project") == "installing-trl_ext-into-another-project"
    assert github_anchor("The course's experiments") == "the-courses-experiments"
    assert github_anchor("Losses, length normalizations: `masked_mean`") == "losses-length-normalizations-masked_mean"


def test_every_link_between_the_pages_resolves():
    """Each relative link of README.md, CHANGELOG.md and docs/*.md names a file that exists, and its ``#anchor`` a
    heading of that file (a section moved to docs/ keeps its links working)."""
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page.read_text())):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []
