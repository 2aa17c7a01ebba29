"""Every Python code block of the README and of the documentation's pages runs, in order, one
real kernel per page. A block that needs what this machine lacks is marked in the page's source
(``<!-- needs: gpu -->`` on the line before it): it is not run, and the test says so as a skip
naming the page, the block and what it needs; nothing is skipped silently."""

from __future__ import annotations

import re

import pytest

from tests.kernel import ROOT, running_kernel

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

BLOCK = re.compile(r"(?:<!-- needs: ([\w, -]+) -->\n)?```python\n(.*?)```", re.S)
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]


def blocks_of(page: str) -> list[tuple[str | None, str]]:
    """(what it needs, or None; the code) for each Python block of ``page``, in order."""
    return [(needs, code) for needs, code in BLOCK.findall((ROOT / page).read_text())]


def met(needs: str) -> bool:
    """Whether this machine has what a block needs (only a GPU can be had here)."""
    if needs == "":
        return True
    if needs.strip() == "gpu":
        import torch

        return torch.cuda.is_available()
    return False


RUN = [page for page in PAGES if any(needs == "" for needs, _ in blocks_of(page))]
NOT_RUN = [(page, i, needs) for page in PAGES for i, (needs, _) in enumerate(blocks_of(page), start=1) if needs]


@pytest.mark.parametrize("page", RUN)
def test_the_python_blocks_of_a_page_run_in_order(page):
    with running_kernel() as kernel:
        runs = [(code, kernel.ok(code)) for needs, code in blocks_of(page) if met(needs)]
    if page == "README.md":  # what its quickstart promises
        magic = next(run for code, run in runs if code.startswith("%%enot_distributed -n 2"))
        assert magic.stdout.startswith("final loss")
        assert "enot_nb note: 'ddp' was not brought back" in magic.stdout  # a quiet note, not stderr


@pytest.mark.parametrize("page, block, needs", NOT_RUN, ids=[f"{p}-{b}" for p, b, _ in NOT_RUN])
def test_blocks_that_need_what_this_machine_lacks_are_named(page, block, needs):
    """Listed, never silently left out: where this machine has what the block needs, the page's
    own test ran it in order with the rest."""
    if not met(needs):
        pytest.skip(f"{page}, Python block {block}: needs {needs}, which this machine lacks")


def test_every_guide_page_is_in_the_sites_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in (ROOT / "docs").rglob("*.md"):
        assert str(page.relative_to(ROOT / "docs")) in nav, page
