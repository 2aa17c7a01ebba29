"""Every Python code block of the README and of the documentation's pages runs, in order, one
real kernel per page. A block that needs what this machine lacks is marked in the page's source
(``<!-- needs: gpu -->`` on the line before it): it is not run, and the test says so as a skip
naming the page, the block and what it needs; nothing is skipped silently.

The site renders as written: built as CI builds it, no page's prose shows reStructuredText that
mkdocstrings leaves as it is (a ``:func:`` role, a ``::`` literal marker, double backticks), and
the notebook pages carry the titles ``mkdocs.yml`` gives them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

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


ONE_MACHINE_RAY = "ray-one-machine"
"""Blocks that need the one-machine Ray cluster their page's terminal steps start (docs/guide/ray.md)."""

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
    if needs == ONE_MACHINE_RAY:
        pytest.skip(f"{page}, Python block {block}: run with its terminal steps by tests/ray_engine/test_ray_docs.py")
    if not met(needs):
        pytest.skip(f"{page}, Python block {block}: needs {needs}, which this machine lacks")


def test_every_guide_page_is_in_the_sites_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in (ROOT / "docs").rglob("*.md"):
        assert str(page.relative_to(ROOT / "docs")) in nav, page


# ----------------------------------------------------------------------------- the built site

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|exc|data|obj|const|ref|doc|term):")
RAW_MARKUP = re.compile(rf"{ROLE.pattern}|::|``")


class PageText(HTMLParser):
    """A built page's text, split into prose and code (``<pre>``, ``<code>``): ``a[::2]`` or
    ``std::vector`` are code; the search index, scripts and styles are neither."""

    CODE = {"pre", "code"}
    HIDDEN = {"script", "style"}

    def __init__(self) -> None:
        super().__init__()
        self.prose: list[str] = []
        self.code: list[str] = []
        self.title = ""
        self._open: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._open.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag in self._open:  # HTML leaves some tags unclosed (<p>, <li>): close up to this one
            del self._open[len(self._open) - 1 - self._open[::-1].index(tag) :]

    def handle_data(self, data: str) -> None:
        if self.HIDDEN & set(self._open):
            return
        if self._open and self._open[-1] == "title":
            self.title += data
        (self.code if self.CODE & set(self._open) else self.prose).append(data)


def page_text(html: str) -> PageText:
    parser = PageText()
    parser.feed(html)
    return parser


def raw_markup(text: str) -> list[str]:
    """Each reStructuredText remnant in ``text``, with some words around it."""
    return [text[max(0, m.start() - 40) : m.end() + 40].strip() for m in RAW_MARKUP.finditer(text)]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built as .ci/run builds it (``--strict``: a broken link or reference fails)."""
    pytest.importorskip("mkdocs", reason="mkdocs comes with the 'docs' extra")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)]
    built = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert built.returncode == 0, built.stderr[-3000:]
    return out


def test_markup_checks_tell_prose_from_code():
    """The checks themselves: what a role, a literal marker or double backticks leave in prose is
    found, and the same characters in code are not."""
    prose = "".join(page_text("<p>runs :func:<code>init_torch</code>, see ``x``</p><p>Example::</p>").prose)
    assert [m.group() for m in RAW_MARKUP.finditer(prose)] == [":func:", "``", "``", "::"]
    code = page_text("<pre><code>a[::2]  # ``x`` :func:</code></pre><p>plain <code>std::vector</code></p>")
    assert raw_markup("".join(code.prose)) == []


def test_no_page_shows_raw_restructuredtext(site):
    found = {}
    for page in sorted(site.rglob("*.html")):
        text = page_text(page.read_text())
        bad = [hit for chunk in text.prose for hit in raw_markup(chunk)]
        if bad:
            found[str(page.relative_to(site))] = bad
    assert not found, f"reStructuredText shown as it is (write [text][enot_nb.path] or `code`): {found}"


def test_the_magics_options_show_no_raw_markup(site):
    """The options page is generated from the magics' argparse help (docs/hooks/magic_options.py),
    which IPython writes for Sphinx: a ``::`` line above the usage, double backticks."""
    text = page_text((site / "reference" / "magics" / "index.html").read_text())
    help_text = "".join(text.code)
    assert "%enot_distributed [-n NPROCS]" in help_text and "%enot_session [-n NPROCS]" in help_text
    assert raw_markup(help_text) == []


def test_notebook_pages_keep_their_titles_from_mkdocs_yml(site):
    """mkdocs-jupyter would title a page by the notebook's first heading (one starting with a code
    span lost it: ": a function on every process")."""
    nav = re.findall(r"^\s*- ([^:\n]+): (notebooks/[\w.]+)\.ipynb$", (ROOT / "mkdocs.yml").read_text(), re.M)
    assert len(nav) == len(list((ROOT / "notebooks").glob("*.ipynb")))
    for title, page in nav:
        assert page_text((site / page / "index.html").read_text()).title.startswith(f"{title} - "), page
