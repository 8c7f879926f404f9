"""Make this working tree's ``zenflow_triton`` importable on a bare machine with no network: the GPU suite's first step.

``zenflow_triton.kernels`` and ``zenflow_triton.autotune`` exist only through pyproject's package-dir mapping (the
folders are ``kernels/`` and ``autotune/`` at the top of the repo), so a fresh checkout cannot run a GPU test or bench
until the package is installed. A lent GPU machine has no network, and its Python may be anything. In order:

1. already importable from this tree (an editable install of it): nothing to do;
2. else, when this interpreter has pip and setuptools >= 77 (pyproject's build requirement: PEP 639 license fields):
   ``pip install --no-index --no-build-isolation --no-deps -e REPO`` (nothing downloaded, nothing else installed);
3. else, or when that fails (older setuptools, an externally managed Python, a read-only site-packages): run from the
   tree. ``zenflow_triton/kernels`` and ``zenflow_triton/autotune`` become relative symbolic links to ``../kernels`` and
   ``../autotune`` (git-ignored), which is the installed layout itself: the package then imports from the tree in this
   process and in every subprocess started with the repository as its working directory (``python -m pytest``), with
   no import hook, no ``PYTHONPATH`` and nothing written outside the tree.

Each check runs ``import zenflow_triton.kernels, zenflow_triton.autotune`` in a fresh interpreter with the repository
as its working directory, as the suite's pytest phases will, and accepts it only if the modules come from this tree.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["LINKS", "ensure_importable"]

# The package-dir mapping of pyproject.toml, as links inside the package folder: (link, target relative to the link).
LINKS = (("zenflow_triton/kernels", "../kernels"), ("zenflow_triton/autotune", "../autotune"))
# pyproject's [build-system] requires.
MIN_SETUPTOOLS = (77,)

_PROBE = ("import json, zenflow_triton, zenflow_triton.kernels as k, zenflow_triton.autotune as a; "
          "print(json.dumps([zenflow_triton.__file__, k.__file__, a.__file__]))")


def _from_tree(repo: Path) -> tuple[bool, str]:
    """Whether a fresh interpreter run in ``repo`` imports the three packages from this tree; and what it said."""
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE], cwd=repo, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return False, "the import check timed out"
    if proc.returncode != 0:
        return False, (proc.stderr.strip().splitlines() or ["import failed"])[-1]
    paths = [Path(p).resolve() for p in json.loads(proc.stdout.strip().splitlines()[-1])]
    wanted = [repo / "zenflow_triton", repo / "kernels", repo / "autotune"]
    ok = all(p.parent == w.resolve() for p, w in zip(paths, wanted))
    return ok, "" if ok else f"imports from elsewhere: {[str(p) for p in paths]}"


def _setuptools_version() -> tuple[int, ...] | None:
    try:
        text = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return None
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _pip_install(repo: Path) -> tuple[bool, str]:
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-build-isolation", "--no-deps",
           "--disable-pip-version-check", "-q", "-e", str(repo)]
    try:
        proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return False, "pip install timed out"
    if proc.returncode != 0:
        said = proc.stderr.strip()[-600:] or proc.stdout[-600:]
        return False, f"pip install -e failed ({proc.returncode}): {said}"
    return True, ""


def _link_tree(repo: Path) -> None:
    for link, target in LINKS:
        path = repo / link
        if path.is_symlink():
            if os.readlink(path) == target:
                continue
            raise RuntimeError(f"{path} is a link to {os.readlink(path)}, not {target}: remove it and rerun")
        if path.exists():
            raise RuntimeError(f"{path} exists and is not the link to {target} this script would make: remove it")
        os.symlink(target, path, target_is_directory=True)


def ensure_importable(repo: Path, *, allow_install: bool = True) -> dict[str, str]:
    """Make ``zenflow_triton`` (with ``.kernels`` and ``.autotune``) importable from ``repo``, here and in subprocesses
    run in ``repo``; return how (``{"how": "installed" | "pip install -e" | "from the tree", "why": ...}``).

    Puts ``repo`` first on this process's ``sys.path``. Raises ``RuntimeError`` with every attempt's reason when
    nothing worked. ``allow_install=False`` skips step 2 (never touches the interpreter's site-packages).
    """
    repo = repo.resolve()
    if str(repo) not in sys.path:
        sys.path.insert(0, str(repo))
    ok, why = _from_tree(repo)
    if ok:
        return {"how": "installed", "why": ""}
    reasons = [f"not importable from the tree: {why}"]
    if allow_install:
        version = _setuptools_version()
        if version is None or version < MIN_SETUPTOOLS:
            found = "none" if version is None else ".".join(map(str, version))
            reasons.append(f"setuptools {found} < 77 (pyproject's build requirement): not installing")
        else:
            installed, why = _pip_install(repo)
            if installed:
                ok, why = _from_tree(repo)
                if ok:
                    _activate_editable()
                    return {"how": "pip install -e", "why": "; ".join(reasons)}
            reasons.append(why)
    _link_tree(repo)
    importlib.invalidate_caches()
    ok, why = _from_tree(repo)
    if not ok:
        raise RuntimeError("zenflow_triton is not importable from this tree: " + "; ".join([*reasons, why]))
    return {"how": "from the tree", "why": "; ".join(reasons)}


def _activate_editable() -> None:
    """The editable install's import hook for this process (new interpreters load it from its ``.pth`` file at start):
    run the hook's ``import`` lines of the ``.pth`` files pip just wrote."""
    import site

    for d in [*site.getsitepackages(), site.getusersitepackages()]:
        for pth in sorted(Path(d).glob("__editable__*zenflow_triton*.pth")):
            for line in pth.read_text().splitlines():
                if line.startswith(("import ", "import\t")):
                    exec(line)  # what site.py does with such a line at interpreter start
                elif line.strip() and line.strip() not in sys.path:
                    sys.path.append(line.strip())
    importlib.invalidate_caches()
