"""The documentation's links resolve and its map is complete: every relative link in README.md and
docs/ (docs/records/ is raw run data, not documentation) names a file that exists, and a heading of it
when the link has an anchor; docs/index.md links every page."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from tests.conftest import ROOT

DOCS = ROOT / "docs"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE = re.compile(r"`[^`\n]*`")
# pages another command writes: a link to one may wait for the command, never outlive it
GENERATED = {"docs/reference/verification.md": "matrix"}


def pages() -> list[Path]:
    found = [p for p in DOCS.rglob("*.md") if DOCS / "records" not in p.parents]
    return [ROOT / "README.md", *sorted(found)]


def prose(path: Path) -> str:
    """The text outside code, where a bracket is markdown and not Python or a shell glob."""
    return CODE.sub("", FENCE.sub("", path.read_text()))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation and symbols dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return "".join(ch for ch in text if ch.isalnum() or ch in " -_").replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a page's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    found: set[str] = set()
    count: dict[str, int] = {}
    for line in FENCE.sub("", path.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*)", line)
        if match:
            base = slug(match.group(1))
            found.add(f"{base}-{count[base]}" if base in count else base)
            count[base] = count.get(base, 0) + 1
    return found


def engine_commands() -> set[str]:
    from engine import cli

    sub = next(a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction))
    return set(sub.choices)


def links(path: Path) -> list[str]:
    targets = [m.group(1) for m in LINK.finditer(prose(path))]
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        name, _, anchor = target.partition("#")
        path = (page.parent / name).resolve()
        where = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
        if not path.exists():
            if where in GENERATED and GENERATED[where] not in engine_commands():
                continue  # the command that writes it is not in this checkout yet
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading #{anchor} in {where}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_generated_pages_exist_once_their_command_does() -> None:
    missing = [
        f"{page} (python -m engine {cmd})"
        for page, cmd in GENERATED.items()
        if cmd in engine_commands() and not (ROOT / page).exists()
    ]
    assert not missing, f"generate: {missing}"


def test_index_links_every_page() -> None:
    index = DOCS / "index.md"
    linked = {(index.parent / t.partition("#")[0]).resolve() for t in links(index)}
    expected = {p.resolve() for p in pages()[1:] if p != index}
    expected |= {(ROOT / page).resolve() for page in GENERATED}
    assert not expected - linked, (
        f"docs/index.md lacks: {sorted(str(p.relative_to(ROOT)) for p in expected - linked)}"
    )


def test_cli_reference_names_every_command() -> None:
    """docs/reference/cli.md has a row for every `python -m engine` command the parser knows."""
    text = (DOCS / "reference" / "cli.md").read_text()
    missing = [cmd for cmd in sorted(engine_commands()) if not re.search(rf"^\| `{cmd}[ `]", text, re.M)]
    assert not missing, f"docs/reference/cli.md lacks a row for: {missing}"
