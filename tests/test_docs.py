"""The README is a landing page and the documentation site covers the kit (issue 48): every link resolves, every
page is in the site's nav, and every public name of `ck.__all__` has a docstring that the API reference shows.
`.ci/run` builds the site with `mkdocs build --strict` and then runs this file against it (COLAB_KIT_SITE)."""

import inspect
import os
import re
from pathlib import Path

import pytest
import yaml
from project import ROOT

import colab_kit as ck

README = ROOT / "README.md"
DOCS = ROOT / "docs"
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def relative_links(page: Path) -> list[str]:
    return [target for target, _ in LINK.findall(page.read_text()) if "://" not in target]


def test_the_readme_is_a_landing_page_whose_links_resolve():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move detail into docs/"
    links = relative_links(README)
    assert any(link.startswith("docs/") for link in links)
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, missing


def nav_pages(nav) -> list[str]:
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_of_docs_is_in_the_sites_nav():
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)  # no !!python tags here
    nav = nav_pages(config["nav"])
    pages = sorted(str((Path(folder) / name).relative_to(DOCS)) for folder, _, names in os.walk(DOCS, followlinks=True)
                   for name in names if Path(name).suffix in (".md", ".ipynb") and ".ipynb_checkpoints" not in folder)
    assert sorted(nav) == pages


def test_every_public_name_has_a_docstring_and_a_place_in_the_reference():
    reference = (DOCS / "reference.md").read_text()
    shown = re.findall(r"^::: colab_kit\.(\w+)$", reference, flags=re.M)
    assert sorted(shown) == sorted(ck.__all__)
    undocumented = [name for name in ck.__all__ if len(inspect.getdoc(getattr(ck, name)) or "") < 20]
    assert not undocumented, undocumented


def test_the_built_reference_shows_each_name_with_its_docstring():
    site = os.environ.get("COLAB_KIT_SITE")
    if not site:
        pytest.skip("no built site: .ci/run runs mkdocs build --strict, then this test with COLAB_KIT_SITE=site")
    html = (Path(site) / "reference" / "index.html").read_text()
    for name in ck.__all__:
        assert f'id="colab_kit.{name}"' in html, name
        first_line = inspect.getdoc(getattr(ck, name)).split("\n", 1)[0]
        plain = max(re.split(r"[`*_\[\]()<>&'\"]", first_line), key=len).strip()  # as the HTML has it, unchanged
        assert plain in html, (name, plain)
