"""The README and docs/ hold together: links land, the index lists every page, CI runs the README's line.

The README is the front door and docs/ the manual, one page per concern; text moves between
them, so a link to a page or a section that moved is the likely break. Pure text checks, no
processes: a few milliseconds.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.multiproc import REPO_ROOT

PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(page: Path) -> str:
    """The page without its fenced code blocks (a `[x](y)` in code is not a link)."""
    return _FENCE.sub("", page.read_text())


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_anchor(line.lstrip("#")) for line in _prose(page).splitlines() if line.startswith("#")}


def _relative_links(page: Path) -> list[str]:
    return [target for target in _LINK.findall(_prose(page))
            if not re.match(r"[a-z]+:", target)]  # https:, mailto: lead outside the repository


def test_every_relative_link_lands_on_a_file_and_heading_that_exist() -> None:
    broken = []
    for page in PAGES:
        for target in _relative_links(page):
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(REPO_ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(REPO_ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_index_lists_every_docs_page() -> None:
    index = REPO_ROOT / "docs" / "index.md"
    listed = {Path(target.partition("#")[0]).name for target in _relative_links(index)}
    pages = {page.name for page in (REPO_ROOT / "docs").glob("*.md")} - {"index.md"}
    assert pages - listed == set(), f"docs/index.md does not list {sorted(pages - listed)}"


def test_ci_runs_the_readme_quickstart_test_line() -> None:
    ci_line = (REPO_ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    readme = (REPO_ROOT / "README.md").read_text()
    quickstart = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    assert ci_line in quickstart.splitlines(), f"README's Quickstart lacks .ci/run's line: {ci_line}"
