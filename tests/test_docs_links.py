"""Every relative link in the README and the docs leads to a file that exists.

The README is the front door and the reference lives in docs/: a page moved or
renamed without its links following would leave a newcomer at a dead end. Links
to other sites are not fetched (tests run offline); an anchor (``#section``) is
not checked, only the file it is in.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", *(ROOT / "docs").glob("*.md")])

# code is not prose: a `[abc](x)` inside it is not a link
FENCED = re.compile(r"^```.*?^```", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def local_targets(text: str) -> list[str]:
    """The link targets of a markdown page that name a file of this repository."""
    prose = INLINE_CODE.sub("", FENCED.sub("", text))
    targets = []
    for target in LINK.findall(prose):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # another site (https:, mailto:) or a place on the same page
        targets.append(target.split("#", 1)[0])
    return targets


def test_the_front_door_links_to_every_guide() -> None:
    readme = set(local_targets((ROOT / "README.md").read_text(encoding="utf-8")))
    guides = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert not guides - readme, f"README links to none of {sorted(guides - readme)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = [t for t in local_targets(page.read_text(encoding="utf-8")) if not (page.parent / t).exists()]
    assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"
