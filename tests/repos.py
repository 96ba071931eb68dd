"""A temporary DVC repository holding the pipeline (its stages, library and dvc.yaml), for tests that run
the real `dvc repro`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT, write_raw_files

GIT = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com"]


def dvc_env() -> dict[str, str]:
    """This interpreter's scripts (dvc, and the stages' python) first on PATH."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


def dvc(repo: Path, *args: str) -> str:
    result = subprocess.run(["dvc", *args], cwd=repo, env=dvc_env(), capture_output=True, text=True)
    assert result.returncode == 0, f"dvc {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def pipeline_repo(repo: Path, raw_files: dict[str, str], write_params) -> Path:
    """`repo` made a git and DVC repository of the pipeline, its raw data `raw_files` under data/raw and
    its params.yaml written by `write_params(repo)` (pointing data.raw_dir at data/raw); one commit."""
    for code in ("stages", "mtbert"):  # the stage commands, and the library dvc.yaml lists as their deps
        shutil.copytree(REPO_ROOT / code, repo / code, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO_ROOT / "dvc.yaml", repo / "dvc.yaml")
    write_params(repo)
    write_raw_files(repo / "data" / "raw", raw_files)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    dvc(repo, "init", "-q")
    shutil.copytree(REPO_ROOT / ".dvc" / "plots", repo / ".dvc" / "plots")  # the curves' chart template
    dvc(repo, "config", "core.analytics", "false")
    subprocess.run([*GIT, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*GIT, "commit", "-qm", "pipeline"], cwd=repo, check=True)  # DVCLive needs a commit
    return repo
