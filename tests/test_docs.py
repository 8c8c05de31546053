"""The front door and the documentation site (issue 32): the README stays short and its links resolve,
and the MkDocs site under docs/ builds strictly (a broken link, a missing anchor, a missing page or
a page left out of the nav fails the build)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|<img[^>]*\bsrc=\"([^\"]+)\"")


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # Material's banner about MkDocs 2.0, not a warning of ours
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=config.parent, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    run = mkdocs_build(ROOT / "mkdocs.yml", out)
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout}\n{run.stderr}"
    return out


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a file's headings: lower case, punctuation dropped, spaces to hyphens."""
    anchors: set[str] = set()
    fenced = False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fenced or not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        n, candidate = 0, slug
        while candidate in anchors:
            n += 1
            candidate = f"{slug}-{n}"
        anchors.add(candidate)
    return anchors


def local_links(markdown: str) -> list[str]:
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)  # code blocks hold no links
    targets = [a or b for a, b in LINK.findall(text)]
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # http:, https:, mailto: are not files


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; the reference belongs in docs/"
    text = "\n".join(lines)
    for needed in ("make demo", "make test", "docs/tui.svg", "docs/notebook.png", "docs/live_page.png",
                   "BENCHMARKS.md"):
        assert needed in text, f"README.md no longer mentions {needed}"


def test_readme_links_resolve():
    readme = ROOT / "README.md"
    text = readme.read_text(encoding="utf-8")
    links = local_links(text)
    assert len(links) >= 10, f"found only {links}: is the link pattern still right?"
    broken = []
    for link in links:
        path, _, anchor = unquote(link).partition("#")
        target = (readme.parent / path).resolve() if path else readme
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in github_anchors(target.read_text(encoding="utf-8")):
            broken.append(f"{link}: {target.name} has no heading with that anchor")
    assert not broken, "README.md links to what is not there:\n" + "\n".join(broken)


def test_site_builds_strictly_with_every_page_and_picture(site):
    pages = {p.parent.name for p in site.glob("*/index.html")}
    for page in ("engine", "families", "inside", "engines", "viewers", "server", "trace-format", "cli",
                 "architecture", "benchmarks"):
        assert page in pages, f"the site has no {page} page (built: {sorted(pages)})"
    missing = []
    for html in site.rglob("*.html"):
        for src in re.findall(r"<img[^>]*\bsrc=\"([^\"]+)\"", html.read_text(encoding="utf-8")):
            if not re.match(r"[a-z]+:", src) and not (html.parent / unquote(src)).resolve().exists():
                missing.append(f"{html.relative_to(site)}: {src}")
    assert not missing, "pictures the site shows but does not hold:\n" + "\n".join(missing)
    # the benchmarks page is BENCHMARKS.md itself, included, so the numbers live in one file
    first = next(line for line in (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8").splitlines()
                 if line.startswith("## "))[3:]
    assert first in (site / "benchmarks" / "index.html").read_text(encoding="utf-8")


def test_strict_build_refuses_a_broken_link(tmp_path):
    """The build above can fail: the same site with one link to a missing anchor does not build."""
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", copy / "docs", ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    for name in ("mkdocs.yml", "BENCHMARKS.md"):
        shutil.copy(ROOT / name, copy / name)
    page = copy / "docs" / "cli.md"
    page.write_text(page.read_text(encoding="utf-8") + "\nSee [nothing](server.md#no-such-section).\n",
                    encoding="utf-8")
    run = mkdocs_build(copy / "mkdocs.yml", tmp_path / "site")
    assert run.returncode != 0, "a link to a missing anchor built without complaint"
    assert "no-such-section" in run.stdout + run.stderr
