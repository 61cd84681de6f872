"""MkDocs hook: the README as the site's home page, the clients' READMEs as pages, and links written
for reading on the repository (`docs/trainer.md` from the README, `../README.md` from docs/)
pointed at the same pages on the site, so one Markdown source serves both."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[2]
DOCS = "docs"
# Pages made from files outside docs/: site path → repository path.
FROM_REPO = {
    "index.md": "README.md",
    "clients.md": "clients/README.md",
    "clients-typescript.md": "clients/typescript/README.md",
}
LINK = re.compile(r"(\]\()([^)\s]+)(\))")
EXTERNAL = re.compile(r"^([a-z][a-z0-9+.-]*:|#|/)", re.IGNORECASE)


def repo_path(site_path: str) -> str:
    return FROM_REPO.get(site_path) or f"{DOCS}/{site_path}"


def site_path(repo: str) -> str | None:
    """The site page or file of a repository path, None when the site does not carry it."""
    for page, source in FROM_REPO.items():
        if source == repo:
            return page
    return repo.removeprefix(f"{DOCS}/") if repo.startswith(f"{DOCS}/") else None


def relink(markdown: str, page_site_path: str) -> str:
    here = repo_path(page_site_path)

    def rewrite(match: re.Match[str]) -> str:
        target = match.group(2)
        if EXTERNAL.match(target):
            return match.group(0)
        path, hash_, anchor = target.partition("#")
        resolved = site_path(posixpath.normpath(posixpath.join(posixpath.dirname(here), path)))
        if resolved is None:  # left as written: strict mode reports it as a broken link
            return match.group(0)
        relative = posixpath.relpath(resolved, posixpath.dirname(page_site_path) or ".")
        return f"{match.group(1)}{relative}{hash_}{anchor}{match.group(3)}"

    return LINK.sub(rewrite, markdown)


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for page, source in FROM_REPO.items():
        files.append(File.generated(config, page, content=(ROOT / source).read_text()))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    return relink(markdown, page.file.src_uri)
