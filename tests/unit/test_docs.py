"""The documentation stays true: the request's hop tables name code that exists, every relative link
lands on a file (and a heading) of the repository, the README stays a page a newcomer reads, and no
file of the repository speaks of how it was made instead of what it is."""

from __future__ import annotations

import ast
import re
import subprocess
import tomllib
import unicodedata
from pathlib import Path

import pytest


def _root() -> Path:
    for folder in Path(__file__).resolve().parents:
        if (folder / "pyproject.toml").is_file():
            return folder
    raise RuntimeError("no pyproject.toml above the tests")


ROOT = _root()
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
README_MAX_LINES = 250

# A hop table: a header row exactly like this one, then rows whose file and function are code spans.
HOP_HEADER = re.compile(r"^\|\s*hop\s*\|\s*file\s*\|\s*function\s*\|\s*what happens\s*\|$")
HOP_ROW = re.compile(r"^\|\s*(?P<hop>[^|`]+?)\s*\|\s*`(?P<file>[^`]+)`\s*\|\s*`(?P<function>[^`]+)`\s*"
                     r"\|(?P<rest>.+)\|$")
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# Markdown and HTML links; code is not looked into (a link in a code block is text).
FENCE = re.compile(r"^(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HTML_LINK = re.compile(r"\b(?:href|src)\s*=\s*\"([^\"]+)\"", re.IGNORECASE)
IMAGE = re.compile(r"!\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)|<img\b[^>]*\bsrc\s*=\s*\"([^\"]+)\"", re.IGNORECASE)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")

# What the repository must not say about itself (case-insensitive, as ``grep -iE``). The brackets keep
# this file from matching its own pattern.
HISTORY = re.compile(r"session [0-9]|previous[ ]session|after[ ]review", re.IGNORECASE)


def markdown_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def prose_lines(text: str, keep_code: bool = False) -> list[tuple[int, str]]:
    """Lines outside fenced code blocks, numbered from 1, their code spans removed unless ``keep_code``."""
    out: list[tuple[int, str]] = []
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        opening = FENCE.match(line.lstrip())
        if fence is not None:
            if opening and line.lstrip().startswith(fence):
                fence = None
            continue
        if opening:
            fence = opening.group(1)
            continue
        out.append((number, line if keep_code else CODE_SPAN.sub("", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text, lowercased, letters, digits, spaces, hyphens and
    underscores kept, spaces made hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    kept = "".join(ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LMN")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(path.read_text(), keep_code=True):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def link_targets(path: Path) -> list[tuple[int, str]]:
    targets = []
    for number, line in prose_lines(path.read_text()):
        for pattern in (INLINE_LINK, HTML_LINK):
            targets += [(number, m.group(1)) for m in pattern.finditer(line)]
        if (reference := REFERENCE_LINK.match(line)) is not None:
            targets.append((number, reference.group(1)))
    return targets


def hop_rows() -> list[dict[str, str]]:
    """Every row of every hop table in architecture.md, in order; a row not in the table's form fails."""
    lines = ARCHITECTURE.read_text().splitlines()
    rows: list[dict[str, str]] = []
    i = 0
    while i < len(lines):
        if not HOP_HEADER.match(lines[i].strip()):
            i += 1
            continue
        assert re.fullmatch(r"\|(\s*:?-{3,}:?\s*\|){4}", lines[i + 1].strip()), (
            f"docs/architecture.md:{i + 2}: a hop table's header must be followed by its separator row")
        i += 2
        while i < len(lines) and lines[i].strip().startswith("|"):
            row = HOP_ROW.match(lines[i].strip())
            assert row is not None, (f"docs/architecture.md:{i + 1}: a hop row is "
                                     "| hop | `path/to/file.py` | `function` or `Class.method` | what happens |")
            assert row["rest"].strip(), f"docs/architecture.md:{i + 1}: say what happens at this hop"
            rows.append({**row.groupdict(), "line": str(i + 1)})
            i += 1
    return rows


def defined(tree: ast.Module, dotted: str) -> bool:
    """Whether ``name`` (a top-level function or class) or ``Class.name`` (a method, property or nested
    class of a top-level class) is defined in the module."""
    body: list[ast.stmt] = tree.body
    parts = dotted.split(".")
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        named = [n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                 and n.name == part]
        classes = [n for n in named if isinstance(n, ast.ClassDef)]
        if not (named if last else classes):
            return False
        if not last:
            body = classes[0].body
    return True


def test_every_hop_names_a_file_and_a_function_that_exist() -> None:
    text = ARCHITECTURE.read_text()
    assert "\n## One request, hop by hop\n" in text, "docs/architecture.md must walk one request hop by hop"
    rows = hop_rows()
    assert len(rows) >= 20, f"the hop tables list {len(rows)} hops: the walk from Client.infer to the reply is gone"
    assert (rows[0]["file"], rows[0]["function"]) == ("producers/client.py", "Client.infer"), (
        "the walk starts where a caller does: `producers/client.py` `Client.infer`")
    missing = []
    trees: dict[str, ast.Module] = {}
    for row in rows:
        where = f"docs/architecture.md:{row['line']} (hop {row['hop']})"
        file, function = row["file"], row["function"]
        if not all(IDENTIFIER.fullmatch(part) for part in function.split(".")):
            missing.append(f"{where}: `{function}` is not a name or Class.name")
            continue
        path = ROOT / file
        if file.startswith("/") or ".." in Path(file).parts or path.suffix != ".py" or not path.is_file():
            missing.append(f"{where}: no Python file {file} in the repository")
            continue
        if file not in trees:
            trees[file] = ast.parse(path.read_text(), file)
        if not defined(trees[file], function):
            missing.append(f"{where}: {file} defines no {function}")
    assert missing == []


def test_every_relative_link_lands_on_a_file_of_the_repository() -> None:
    broken = []
    for doc in markdown_files():
        name = doc.relative_to(ROOT)
        for number, target in link_targets(doc):
            if SCHEME.match(target) or target.startswith("//"):
                continue  # a URL: not this repository's to check
            file_part, _, fragment = target.partition("#")
            dest = (doc.parent / file_part).resolve() if file_part else doc.resolve()
            try:
                dest.relative_to(ROOT.resolve())
            except ValueError:
                broken.append(f"{name}:{number}: {target} leaves the repository")
                continue
            if not dest.exists():
                broken.append(f"{name}:{number}: {target}: no such file")
            elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                broken.append(f"{name}:{number}: {target}: no heading #{fragment} in {dest.relative_to(ROOT)}")
    assert broken == []


def test_the_readme_links_every_page_of_the_docs() -> None:
    linked = {(README.parent / t.partition("#")[0]).resolve() for _, t in link_targets(README)
              if not SCHEME.match(t) and t.partition("#")[0]}
    pages = sorted((ROOT / "docs").glob("*.md"))
    unlinked = [p.relative_to(ROOT).as_posix() for p in pages if p.resolve() not in linked]
    assert unlinked == [], "the README's table of documentation must link every page of docs/"


def test_the_readme_is_a_page_and_works_as_the_package_description() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: more than {README_MAX_LINES}"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["readme"] == "README.md"
    # The README is the wheel's long description, shown where relative paths lead nowhere: no pictures
    # from the repository, and nothing outside it.
    images = [m.group(1) or m.group(2) for _, line in prose_lines(README.read_text()) for m in IMAGE.finditer(line)]
    assert [i for i in images if not SCHEME.match(i)] == []
    assert "DESIGN.md" not in README.read_text()


def tracked_files() -> list[Path]:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / name for name in dict.fromkeys(listed.decode().split("\0")) if name]


def test_no_file_tells_how_the_project_was_made() -> None:
    files = tracked_files()
    assert README in files
    found = []
    for path in files:
        if path.is_symlink() or not path.is_file():
            continue  # kinfer/<package> links to the folders, whose files are listed themselves
        data = path.read_bytes()
        if b"\0" in data:
            continue  # binary (grep -I)
        for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            if HISTORY.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    assert found == []
