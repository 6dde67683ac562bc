"""The documentation site as `mkdocs build --strict` makes it (.ci/run builds it too): the Mermaid diagrams render
with no internet access, because the site serves Mermaid itself and the theme only fetches it from a CDN when the page
has not defined it; no page links a font (or anything else) on another host."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs", reason="the docs extra (pip install -e '.[docs]') builds the site")
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=REPO,
                           capture_output=True, text=True, timeout=300, env={"NO_MKDOCS_2_WARNING": "1",
                                                                             "PATH": "/usr/bin:/bin"})
    assert built.returncode == 0, built.stderr[-3000:]
    return out


def test_pages_with_diagrams_load_the_sites_own_mermaid(site):
    pages = [p for p in (REPO / "docs").rglob("*.md") if "```mermaid" in p.read_text()]
    assert pages
    for page in pages:
        relative = page.relative_to(REPO / "docs").with_suffix("")
        html = (site / (relative.parent if relative.name == "index" else relative) / "index.html").read_text()
        assert 'class="mermaid"' in html, page
        scripts = re.findall(r'<script src="([^"]+)"', html)
        mermaid = [s for s in scripts if s.endswith("javascripts/mermaid.min.js")]
        assert mermaid and not any(s.startswith(("http:", "https:", "//")) for s in scripts), scripts
        assert ((site / (relative.parent if relative.name == "index" else relative)) / mermaid[0]).resolve().is_file()
    served = (site / "javascripts" / "mermaid.min.js").read_text()
    assert 'globalThis["mermaid"]' in served  # what the theme looks for before it reaches for unpkg.com


def test_no_page_reaches_for_another_host(site):
    """Material's default links Google Fonts from every page: with `font: false` the pages use the system's fonts, and
    no stylesheet, script or font is fetched from anywhere but the site itself."""
    pages = list(site.rglob("*.html"))
    assert len(pages) > 10
    for page in pages:
        html = page.read_text()
        assert "fonts.googleapis.com" not in html and "fonts.gstatic.com" not in html, page
        fetched = re.findall(r'<(?:link|script)[^>]+(?:href|src)="((?:https?:)?//[^"]+)"', html)
        assert not fetched, (page, fetched)


@pytest.mark.skipif(shutil.which("node") is None, reason="node checks the script's syntax")
def test_the_served_mermaid_is_a_whole_script():
    checked = subprocess.run(["node", "--check", str(REPO / "docs" / "javascripts" / "mermaid.min.js")],
                             capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stderr[-2000:]
