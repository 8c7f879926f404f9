"""The device command on a bare machine (``bench/tree_install.py``): ``python bench/gpu_suite.py OUTDIR --dry-run`` from
a fresh clone of this working tree, in a fresh virtual environment whose pip cannot reach any index, with the
packages already present (those of the interpreter running the tests, through a ``.pth`` file; this tree's own
installation left out of sight). Two cases: the venv's bundled setuptools is older than pyproject's >= 77 (what
``python -m venv`` gives with Python 3.11: setuptools 65), so the suite runs from the tree; and a venv without its own
pip, which sees this interpreter's pip and setuptools, so the suite installs the clone with ``pip install -e``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def _fresh_clone(dest: Path) -> Path:
    """A git clone of this repo with the working tree's uncommitted changes on top (what is tested is this code)."""
    _git("clone", "-q", "--no-hardlinks", str(REPO), str(dest), cwd=REPO)
    changed = _git("ls-files", "-z", "--modified", "--others", "--exclude-standard", cwd=REPO).split("\0")
    for rel in filter(None, changed):
        src, dst = REPO / rel, dest / rel
        if src.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
        elif dst.exists():
            dst.unlink()
    return dest


def _fresh_venv(dest: Path, *, with_pip: bool) -> Path:
    venv.EnvBuilder(with_pip=with_pip, system_site_packages=False).create(dest)
    python = dest / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    # The packages of the interpreter running this test, as path lines (appended after the venv's own site-packages,
    # so the venv's pip and setuptools win; .pth files inside those folders, this tree's editable hook among them,
    # are not run: only a site folder's own are).
    here = [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and Path(p).is_dir()]
    (Path(purelib) / "test_packages.pth").write_text("\n".join(here) + "\n")
    return python


def _bare_env() -> dict[str, str]:
    """This environment without Python, pip or Triton settings, and a pip that cannot reach an index."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV", "TRITON"))}
    env.update(PIP_NO_INDEX="1", PIP_INDEX_URL="http://127.0.0.1:9/", PIP_NO_CACHE_DIR="1")
    return env


def _run_suite(python: Path, clone: Path, out: Path, *args: str) -> dict:
    proc = subprocess.run([str(python), "bench/gpu_suite.py", str(out), "--dry-run", *args], cwd=clone, env=_bare_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads((out / "gpu_suite.json").read_text())


def test_bare_venv_with_old_setuptools_runs_from_the_tree(tmp_path: Path) -> None:
    clone = _fresh_clone(tmp_path / "clone")
    python = _fresh_venv(tmp_path / "venv", with_pip=True)
    version = subprocess.run([str(python), "-c", "import setuptools; print(setuptools.__version__)"],
                             capture_output=True, text=True).stdout.strip()
    if not version or int(version.split(".")[0]) >= 77:
        pytest.fail(f"the fresh venv's setuptools is {version or 'missing'}, not < 77: this test needs rewriting")
    before = _git("status", "--porcelain", cwd=clone)
    report = _run_suite(python, clone, tmp_path / "out", "--providers", "zenflow")
    assert report["install"]["how"] == "from the tree", report["install"]
    assert f"setuptools {version}" in report["install"]["why"]
    for link, target in (("zenflow_triton/kernels", "../kernels"), ("zenflow_triton/autotune", "../autotune")):
        assert os.readlink(clone / link) == target
    assert _git("status", "--porcelain", cwd=clone) == before  # the links are git-ignored
    # The pytest phases imported zenflow_triton.kernels in subprocesses: the GPU tests were collected (and skipped
    # without CUDA), not an import error.
    gpu = report["gpu_tests"]
    assert gpu["returncode"] in (0, 5) and gpu["tests"] > 20 and gpu["failures"] == gpu["errors"] == 0, gpu
    assert report["stress_tests"]["returncode"] in (0, 5), report["stress_tests"]
    assert report["device_kernels"]["returncode"] in (0, 5), report["device_kernels"]
    (row,) = report["e2e"]
    assert row["name"] == "zenflow" and "error" not in row and row["step_s"] > 0, row.get("traceback")


def test_bare_venv_with_new_setuptools_installs_the_clone(tmp_path: Path) -> None:
    # The suite's own run is the test above; here only its first step, which decides how the package is found.
    clone = _fresh_clone(tmp_path / "clone")
    python = _fresh_venv(tmp_path / "venv", with_pip=False)  # this interpreter's pip and setuptools (>= 77) apply
    script = ("import json, sys; from pathlib import Path; sys.path.insert(0, 'bench'); import tree_install; "
              "print(json.dumps(tree_install.ensure_importable(Path('.'))))")
    proc = subprocess.run([str(python), "-c", script], cwd=clone, env=_bare_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    how = json.loads(proc.stdout.strip().splitlines()[-1])
    assert how["how"] == "pip install -e", how
    assert not (clone / "zenflow_triton" / "kernels").exists()
    # Installed into the fresh venv, editable: a new interpreter there imports the clone's kernels from anywhere.
    where = subprocess.run([str(python), "-c", "import zenflow_triton.kernels as k; print(k.__file__)"],
                           cwd=tmp_path, env=_bare_env(), capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).resolve().parent == (clone / "kernels").resolve()
