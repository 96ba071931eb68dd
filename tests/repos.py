"""A temporary DVC repository holding the pipeline (its stages, library and dvc.yaml), for tests that run
the real `dvc repro`."""

from __future__ import annotations

import configparser
import os
import shutil
import stat
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


def project_cache_type() -> str:
    """How the project's `.dvc/config` puts cached outputs in the workspace (`cache.type`)."""
    config = configparser.ConfigParser()
    config.read(REPO_ROOT / ".dvc" / "config")
    return config["cache"]["type"].strip('"')


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
    dvc(repo, "config", "cache.type", project_cache_type())  # outputs linked to DVC's cache, as in the project
    subprocess.run([*GIT, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*GIT, "commit", "-qm", "pipeline"], cwd=repo, check=True)  # DVCLive needs a commit
    return repo


def copy_repo(repo: Path, destination: Path) -> Path:
    """A copy of a pipeline repository, to change and run apart from it. The files DVC links to its cache
    are read-only, and nothing writes them in place (DVC removes an output before its stage runs), so the
    copy links them too: copied, they would take their disk twice more (the cache's and the workspace's)."""

    def link_if_read_only(source: str, target: str) -> str:
        if os.stat(source).st_mode & stat.S_IWUSR:
            return shutil.copy2(source, target)
        os.link(source, target)
        return target

    shutil.copytree(repo, destination, symlinks=True, copy_function=link_if_read_only)
    return destination
