"""The documents' links resolve, the repository paths that README.md and docs/*.md write
in code spans exist (docs/notes/, the lab notebooks, may name files as they were), and
benchmarks/results/ is laid out as its README says: the top level holds the files
README.md, docs/performance.md and docs/accuracy.md cite, log/ the experiment logs, and the
README lists every file of both."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), RESULTS / "README.md"]
CURRENT_DOCS = [ROOT / "README.md", ROOT / "docs" / "performance.md", ROOT / "docs" / "accuracy.md"]
# [text](target) and ![alt](target); the target ends at whitespace or the closing parenthesis
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
# a path into the results folder written out in prose, a code span or a comment
RESULTS_PATH = re.compile(r"benchmarks/results/[\w./*{},-]*")
# the current documents, whose code spans must name paths that exist
TOP_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE_SPAN = re.compile(r"`([^`\n]+)`")
# a word of a code span that is a repository path: from the root (`fp4attn/api.py`,
# `tests/...`, `tools/x.py`) or inside the package (`reference/forward.py`)
REPO_PATH = re.compile(r"(?:fp4attn|tests|tools|scripts|benchmarks|dev|docs|\.ci)/[\w./*-]*")
PACKAGE_PATH = re.compile(r"(?:kernels|reference|formats|cli|integrations|study|data)/[\w./*-]*")


def relative_links(text: str) -> list[str]:
    """The link targets of a markdown text that name a file of this repository (no URL,
    no mail address, no anchor within the page), without their #fragment."""
    targets = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


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


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    missing = [t for t in relative_links(doc.read_text()) if not (doc.parent / t).exists()]
    assert not missing, f"{doc.relative_to(ROOT)} links to files that do not exist: {missing}"


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
