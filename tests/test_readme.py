"""README.md and docs/*.md: every Python example runs as written, every command names a script and flags that exist,
every link resolves, and every figure says which command and which bench/results file made it.

Fences say how a block is checked:
- ```python: run here, on CPU.
- ```python frameworks: run by tests/test_frameworks.py (needs the `frameworks` extra).
- ```python torchrun: run by tests/test_fsdp.py in two spawned processes (needs torchrun's environment).
- ```bash: not run here, for a stated reason: installs need a package index, the benches and the quality runs take
  minutes to an hour (tests/test_demo.py and the bench smoke jobs run them small), and bench/gpu_suite.py needs CUDA.
  Each command is checked instead: its script or module exists, every `--flag` it passes is one that script's
  parser defines, every path it reads exists, and every extra it installs is in pyproject.toml.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TEXT = {p: p.read_text(encoding="utf-8") for p in PAGES}
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", flags=re.S | re.M)
# Python fences run elsewhere, and by which test.
ELSEWHERE = {"python frameworks": "tests/test_frameworks.py", "python torchrun": "tests/test_fsdp.py"}


def _blocks(kind: str) -> list[tuple[str, int, str]]:
    return [(p.relative_to(ROOT).as_posix(), i, code) for p in PAGES
            for i, (info, code) in enumerate(FENCE.findall(TEXT[p])) if info.strip() == kind]


PYTHON = _blocks("python")
BASH = _blocks("bash")


def test_readme_has_examples() -> None:
    assert any(page == "README.md" for page, _, _ in PYTHON), "README.md lost its Python examples"


def test_every_fence_has_a_known_kind() -> None:
    """A block in a fence nobody runs or checks would rot unseen."""
    known = {"python", "bash", "text", *ELSEWHERE}
    odd = [(p.name, info) for p in PAGES for info, _ in FENCE.findall(TEXT[p]) if info.strip() not in known]
    assert not odd, f"fences that no test runs or checks: {odd}"


@pytest.mark.parametrize(("page", "index", "code"), PYTHON, ids=[f"{p}:{i}" for p, i, _ in PYTHON])
def test_python_example_runs(page: str, index: int, code: str, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    code = code.replace("/tmp/ckpt.pt", str(tmp_path / "ckpt.pt"))
    exec(compile(code, f"{page} example {index}", "exec"), {"__name__": "__readme__"})


# ------------------------------------------------------------------------------------------------- commands


def _commands(code: str) -> list[list[str]]:
    """The shell commands of a bash block: continuations joined, comments dropped, split at && and |."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        for part in re.split(r"&&|\|", line):
            words = shlex.split(part)
            while words and (re.fullmatch(r"[A-Z_]+=\S*", words[0]) or words[0] in ("nice", "timeout")):
                words = words[3:] if words[0] == "nice" and words[1:2] == ["-n"] else words[1:]
            if words:
                out.append(words)
    return out


def _target_source(words: list[str]) -> tuple[str, list[str]] | None:
    """(the source text of the script or module a python command runs, its arguments); None for pytest."""
    args = words[1:]
    if args[:1] == ["-m"]:
        module, args = args[1], args[2:]
        if module == "pytest":
            return None
        parts = module.split(".")
        mapped = {"kernels": "kernels", "autotune": "autotune"}
        base = ROOT / (mapped[parts[1]] if len(parts) > 1 and parts[1] in mapped else parts[0])
        rest = parts[2:] if len(parts) > 1 and parts[1] in mapped else parts[1:]
        path = base.joinpath(*rest)
        folder = path if path.is_dir() else path.parent
        assert path.is_dir() or path.with_suffix(".py").is_file(), f"no module {module}"
        files = sorted(folder.glob("*.py")) if path.is_dir() else [path.with_suffix(".py")]
        return "\n".join(f.read_text(encoding="utf-8") for f in files), args
    script = ROOT / args[0]
    assert script.is_file(), f"no script {args[0]}"
    return script.read_text(encoding="utf-8"), args[1:]


@pytest.mark.parametrize(("page", "index", "code"), BASH, ids=[f"{p}:{i}" for p, i, _ in BASH])
def test_command_names_what_exists(page: str, index: int, code: str) -> None:
    extras = re.search(r"\[project\.optional-dependencies\](.*?)\n\[", (ROOT / "pyproject.toml").read_text(),
                       flags=re.S).group(1)
    for words in _commands(code):
        if words[:2] == ["pip", "install"]:
            for spec in words[2:]:
                for extra in re.findall(r"\[([^\]]+)\]", spec):
                    for name in extra.split(","):
                        assert re.search(rf"^{name} = ", extras, flags=re.M), f"{page}: no extra {name!r}"
            continue
        assert words[0] in ("python", "python3", "torchrun"), f"{page}: a command this test cannot check: {words}"
        if words[0] == "torchrun":
            continue
        found = _target_source(words)
        if found is None:  # pytest: the paths it is given exist
            assert all((ROOT / a.split("::")[0]).exists() for a in words[3:] if not a.startswith("-")), words
            continue
        source, args = found
        for flag in (a.split("=", 1)[0] for a in args if a.startswith("--")):
            assert f'"{flag}"' in source, f"{page}: {' '.join(words[:3])} has no flag {flag}"
        for arg in args:
            if arg.startswith(("bench/", "autotune/", "tests/")) and not arg.startswith("bench/results/memory-"):
                if "--out" not in args or args[args.index("--out") + 1] != arg:
                    assert (ROOT / arg).exists(), f"{page}: {arg} does not exist"


# ------------------------------------------------------------------------------------------------- links, figures


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    return {_slug(h) for h in re.findall(r"^#+ (.*)$", text, flags=re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_resolve(page: Path) -> None:
    text = re.sub(r"^```.*?^```", "", TEXT[page], flags=re.S | re.M)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        assert path.exists(), f"{page.name}: link to {target}, which does not exist"
        if anchor and path.suffix == ".md":
            assert anchor in _anchors(path), f"{page.name}: no heading #{anchor} in {path.name}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_figure_cites_its_command_and_record(page: Path) -> None:
    """An image is followed by a Source line; every Source line names a command (in backticks, checked as the bash
    blocks are) and a record under bench/results/ (or autotune/) that exists."""
    lines = TEXT[page].splitlines()
    for i, line in enumerate(lines):
        image = re.match(r"!\[[^\]]+\]\(([^)]+)\)", line)
        if image:
            png = page.parent / image.group(1)
            assert png.is_file() and png.stat().st_size < 150_000, f"{page.name}: {png} missing or over 150 KB"
            assert any(x.startswith("Source:") for x in lines[i + 1:i + 4]), f"{page.name}: {png.name} cites nothing"
    paragraphs = re.split(r"\n\s*\n", TEXT[page])
    for para in (p for p in paragraphs if "Source:" in p):
        cited = para.split("Source:", 1)[1]
        commands = [c for c in re.findall(r"`([^`]+)`", cited) if c.split()[0] in ("python", "nice")]
        assert commands or "commands in the record" in cited or "command:" in cited, f"{page.name}: {cited[:80]}"
        for command in commands:
            test_command_names_what_exists(page.name, -1, " ".join(command.split()))
        records = re.findall(r"\]\(([^)]*(?:bench/results|autotune)/[^)]+)\)|(autotune/\w+\.json)", cited)
        assert records, f"{page.name}: a Source without a record: {cited[:80]}"
        for link, bare in records:
            assert ((page.parent / link) if link else (ROOT / bare)).is_file(), f"{page.name}: {link or bare}"


def test_readme_is_a_front_page() -> None:
    readme = TEXT[ROOT / "README.md"]
    assert len(readme.splitlines()) <= 300, "README.md is a front page: depth goes to docs/"
    first_screen = "\n".join(readme.splitlines()[:20])
    assert "(#on-a-gpu)" in first_screen, "the GPU recipe must be reachable from the README's first screen"
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"


# ------------------------------------------------------------------------------------------------- the figures' script


@contextlib.contextmanager
def _bench_on_path():
    """bench/ first on sys.path, as for a script run from it: plot_docs imports its siblings (report_memory,
    quality_fair) by their bare names, and only while it runs."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        yield
    finally:
        sys.path.remove(str(ROOT / "bench"))


def _plot_docs():
    spec = importlib.util.spec_from_file_location("plot_docs", ROOT / "bench" / "plot_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quality_figure_regenerates(tmp_path) -> None:
    """docs/quality.png's command, run on the record it cites, draws a figure of the committed kind."""
    plot_docs = _plot_docs()
    out = tmp_path / "quality.png"
    with _bench_on_path():
        plot_docs.main(["quality", "--json", str(ROOT / "bench/results/quality-fair-2026-12-02.json"), "--png",
                        str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and 10_000 < out.stat().st_size < 150_000


def test_largest_model_is_the_tighter_memory() -> None:
    """The largest-model table: billions of parameters = min(80% of the GPU / device B, 90% of the host / host B)."""
    plot_docs = _plot_docs()
    rows = [{"optimizer": "x", "model": "bfloat16", "device_held": 8.0, "device_peak": 9.0, "host": 16.0},
            {"optimizer": "fp32: left out", "model": "float32", "device_held": 1.0, "device_peak": 1.0, "host": 1.0}]
    table = plot_docs.largest_models(rows)
    ours = table[0]
    assert ours["optimizer"] == "x" and len(table) == 1 + len(plot_docs.PEERS_HOST)
    (gb24, bound24), (gb80, bound80), (h200, bound_h200) = ours["fits"]
    assert (gb24, bound24) == (pytest.approx(0.8 * 24 / 8), "GPU")      # 2.4 B by the GPU, 3.6 B by the host
    assert (gb80, bound80) == (pytest.approx(0.8 * 80 / 8), "GPU")      # 8.0 by the GPU, 14.4 by the host
    assert (h200, bound_h200) == (pytest.approx(0.9 * 128 * 2**30 / 16 / 1e9), "host")  # 7.7 by the host, 14.1 GPU


def _generated(command: str) -> set[str]:
    """The table lines a bench/plot_docs.py command produces: the record it wrote (memory) or the table it prints
    from the record it reads (quality)."""
    words = command.split()
    if words[2] == "memory":
        return set((ROOT / (words[words.index("--out") + 1] + ".md")).read_text(encoding="utf-8").splitlines())
    doc = json.loads((ROOT / words[words.index("--json") + 1]).read_text(encoding="utf-8"))
    with _bench_on_path():
        return set(_plot_docs().quality_table(doc).splitlines())


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_generated_tables_are_pasted_unchanged(page: Path) -> None:
    """A table under a `Source: python bench/plot_docs.py ...` line is rows of what that command writes, verbatim:
    the pages are regenerated from the records, never edited by hand."""
    source = None
    for para in re.split(r"\n\s*\n", re.sub(r"^```.*?^```", "", TEXT[page], flags=re.S | re.M)):
        if para.lstrip().startswith("#"):
            source = None  # a new section: its tables cite their own source
        elif "Source:" in para:
            cited = re.findall(r"`([^`]+)`", " ".join(para.split("Source:", 1)[1].split()))
            source = next((c for c in cited if c.startswith("python bench/plot_docs.py")), None)
        elif para.lstrip().startswith("|") and source is not None:
            rows = [line for line in para.strip().splitlines() if not re.fullmatch(r"\|[-:| ]+\|", line)]
            missing = [row for row in rows if row not in _generated(source)]
            assert not missing, f"{page.name}: rows not in the output of {source}: {missing}"
