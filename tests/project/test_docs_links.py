"""The documents' links resolve (a #fragment into a markdown file to one of its headings),
the repository paths that README.md, docs/*.md and the design notes docs/notes/*.md write in
code spans exist, every docs/...md path written out in the code or the documents exists, and
benchmarks/results/ is laid out as its README says: the top level holds the files
README.md, docs/performance.md and docs/accuracy.md cite, log/ the experiment logs, and the
README lists every file of both.

docs/notes/archive/ holds the lab notebooks, kept verbatim: their links are checked like
every document's, but not their code spans nor the docs paths they write, because they
describe the code as it was when each section was written (files since moved or removed)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), RESULTS / "README.md"]
CURRENT_DOCS = [ROOT / "README.md", ROOT / "docs" / "performance.md", ROOT / "docs" / "accuracy.md"]
# [text](target) and ![alt](target); the target ends at whitespace or the closing parenthesis
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
# a path into the results folder written out in prose, a code span or a comment
RESULTS_PATH = re.compile(r"benchmarks/results/[\w./*{},-]*")
# the current documents, whose code spans must name paths that exist: README.md, docs/*.md
# and the design notes; not docs/notes/archive/ (verbatim notebooks of past code)
ARCHIVE = ROOT / "docs" / "notes" / "archive"
TOP_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "notes").glob("*.md"))]
# a document's path written out in prose, a code span or a comment
DOCS_PATH = re.compile(r"docs/[\w./-]*\.md")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
# a word of a code span that is a repository path: from the root (`fp4attn/api.py`,
# `tests/...`, `tools/x.py`) or inside the package (`reference/forward.py`)
REPO_PATH = re.compile(r"(?:fp4attn|tests|tools|scripts|benchmarks|dev|docs|\.ci)/[\w./*-]*")
PACKAGE_PATH = re.compile(r"(?:kernels|reference|formats|cli|integrations|study|data)/[\w./*-]*")


def relative_links(text: str) -> list[str]:
    """The link targets of a markdown text that name a file of this repository (no URL,
    no mail address, no anchor within the page), without their #fragment."""
    return [target.split("#", 1)[0] for target in _file_links(text)]


def _file_links(text: str) -> list[str]:
    """The link targets of a markdown text that name a file of this repository, with their
    #fragment."""
    return [t for t in LINK.findall(text) if not (re.match(r"[a-z][a-z0-9+.-]*:", t) or t.startswith("#"))]


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a markdown text's headings: the heading's text as rendered
    (links by their text, code spans without backticks), lower case, every character but
    letters, digits, "_", "-" and spaces removed, spaces as "-"; a repeated anchor gets
    "-1", "-2", ..."""
    anchors, seen = set(), {}
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6} (.*)", line)
        if not m:
            continue
        rendered = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1)).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", rendered.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def expand_braces(text: str) -> str:
    """`h200-x-{1,2}.json` written out as `h200-x-1.json h200-x-2.json`."""
    return re.sub(r"([\w.-]*)\{([\w,]+)\}([\w.-]*)",
                  lambda m: " ".join(m[1] + alt + m[3] for alt in m[2].split(",")), text)


def code_span_paths(text: str) -> list[str]:
    """The repository paths (from the root) that a markdown text's code spans name; a span
    followed by "at <commit>" names a file as it was then and is left out."""
    paths = []
    for m in CODE_SPAN.finditer(text):
        if re.match(r" at [0-9a-f]{7}", text[m.end():]):
            continue
        for word in m.group(1).split():
            word = word.strip("()[],;:'\"").rstrip(".")
            if REPO_PATH.fullmatch(word):
                paths.append(word)
            elif PACKAGE_PATH.fullmatch(word):
                paths.append(f"fp4attn/{word}")
    return paths


def _exists(path: str) -> bool:
    return any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()


def test_code_span_paths_parse():
    text = ("`fp4attn/api.py`, `python tools/x.py --y`, `reference/forward.py`, `attention(q)`, "
            "`kernels/hopper/cuda/*.cu`, `scripts/old.py` at 1234abc, `tests/`, ```bash\nls\n```")
    assert code_span_paths(text) == ["fp4attn/api.py", "tools/x.py", "fp4attn/reference/forward.py",
                                     "fp4attn/kernels/hopper/cuda/*.cu", "tests/"]


@pytest.mark.parametrize("doc", TOP_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_code_span_path_exists(doc):
    missing = [p for p in code_span_paths(doc.read_text()) if not _exists(p)]
    assert not missing, (f"{doc.relative_to(ROOT)} names, in code spans, paths that do not exist: {missing} "
                         "(a file as it was: write \"at <commit>\" after the span)")


def test_relative_links_parse_as_markdown_does():
    text = ("see [a](docs/a.md#s), ![p](../x.png \"title\"), [web](https://x.org/a), [mail](mailto:a@b),"
            " [top](#usage), [spaces](are not a target), [`f.txt`](log/f.txt)")
    assert relative_links(text) == ["docs/a.md", "../x.png", "log/f.txt"]
    assert expand_braces("(`h200-r-{1,2}.json`)") == "(`h200-r-1.json h200-r-2.json`)"


def test_heading_anchors_are_githubs():
    text = ("# Title\n## Odd lengths: V^T loaded (found, fixed)\n### `train-fp8` on the [notes](a.md)\n"
            "## CUDA C++ with PTX\n## Consumer (sm_120 / sm_121)\n## Key masks\n## Key masks\n```\n## not a heading\n```")
    assert heading_anchors(text) == {"title", "odd-lengths-vt-loaded-found-fixed", "train-fp8-on-the-notes",
                                     "cuda-c-with-ptx", "consumer-sm_120--sm_121", "key-masks", "key-masks-1"}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    missing = [t for t in relative_links(doc.read_text()) if not (doc.parent / t).exists()]
    assert not missing, f"{doc.relative_to(ROOT)} links to files that do not exist: {missing}"
    # a #fragment into a markdown file names one of its headings (the notes' history links
    # point at the notebooks' sections)
    stale = []
    for target in _file_links(doc.read_text()):
        path, _, fragment = target.partition("#")
        if fragment and path.endswith(".md") and fragment not in heading_anchors((doc.parent / path).read_text()):
            stale.append(target)
    assert not stale, f"{doc.relative_to(ROOT)} links to headings that do not exist: {stale}"


def test_every_docs_path_written_out_exists():
    """`docs/...md` written as text in the code, the scripts, the tests and the current
    documents names a file that exists: a moved or merged note leaves no stale path behind.
    (The archived notebooks may name notes as they were.)"""
    sources = [d for d in DOCS if ARCHIVE not in d.parents]
    sources += sorted(p for d in ("fp4attn", "tools", "tests", "scripts", "dev", "benchmarks") for p in (ROOT / d).rglob("*")
                      if p.suffix in (".py", ".sh", ".md", ".cu", ".cuh") and p.name != "test_docs_links.py")
    stale = [f"{path.relative_to(ROOT)}: {m.group(0)}" for path in sources
             for m in DOCS_PATH.finditer(path.read_text()) if not (ROOT / m.group(0)).exists()]
    assert not stale, stale


def test_every_results_path_written_out_exists():
    """`benchmarks/results/...` written as text (docs, code comments, tools) names a file
    or folder that exists: a moved result file leaves no stale path behind."""
    sources = DOCS + sorted(p for d in ("fp4attn", "tools", "tests", "scripts") for p in (ROOT / d).rglob("*")
                            if p.suffix in (".py", ".sh", ".md"))
    stale = []
    for path in sources:
        text = path.read_text()
        for m in RESULTS_PATH.finditer(text):
            name = m.group(0).rstrip(".,")
            # a pattern (`sm100-*.json`, `-{1,2,3}.json`), or a file as it was at a commit
            if "*" in name or "{" in name or re.match(r"`? at [0-9a-f]{7}", text[m.end():]):
                continue
            if not (ROOT / name).exists():
                stale.append(f"{path.relative_to(ROOT)}: {name}")
    assert not stale, stale


def test_results_folder_layout():
    """Top level: only what README.md, docs/performance.md or docs/accuracy.md cite (by
    name); log/: the rest. The results README links every file of both."""
    cited = expand_braces("\n".join(p.read_text() for p in CURRENT_DOCS))
    top = sorted(p.name for p in RESULTS.iterdir() if p.is_file() and p.name != "README.md")
    uncited = [n for n in top if not re.search(rf"(?<![\w.-]){re.escape(n)}(?![\w.-])", cited)]
    assert not uncited, (f"benchmarks/results/ holds files that README.md, docs/performance.md and "
                         f"docs/accuracy.md do not cite; move them to benchmarks/results/log/: {uncited}")
    # about 40: every file cited for a current figure (48 with the affine presets' runs, the
    # decode study and the sm_120a report); more means logs have crept back
    assert len(top) <= 50, f"{len(top)} files at benchmarks/results/'s top level: logs belong in log/"
    listed = set(relative_links((RESULTS / "README.md").read_text()))
    files = top + [f"log/{p.name}" for p in sorted((RESULTS / "log").iterdir()) if p.is_file()]
    unlisted = [f for f in files if f not in listed]
    assert not unlisted, f"benchmarks/results/README.md does not list (as a link) {unlisted}"
