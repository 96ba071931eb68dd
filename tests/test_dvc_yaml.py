"""dvc.yaml lists, for every stage, each stages/ and mtbert/ module its command imports (directly or not).

A module missing from a stage's deps would let `dvc repro` skip a stage whose code changed.
"""

import ast
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO_ROOT


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(("stages", "mtbert")):
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names if alias.name.startswith(("stages", "mtbert")))
    return names


def module_file(name: str) -> Path | None:
    path = REPO_ROOT / Path(*name.split("."))
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else None


def transitive_files(entry: Path) -> set[str]:
    seen: set[Path] = set()
    pending = [entry]
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        pending.extend(f for f in map(module_file, imported_modules(path)) if f is not None)
    return {str(p.relative_to(REPO_ROOT)) for p in seen}


STAGES = yaml.safe_load((REPO_ROOT / "dvc.yaml").read_text())["stages"]


@pytest.mark.parametrize("name", sorted(STAGES))
def test_stage_deps_cover_every_imported_module(name):
    stage = STAGES[name].get("do", STAGES[name])
    module = stage["cmd"].split("python -m ")[1].split()[0]
    needed = transitive_files(module_file(module))
    assert needed <= set(stage["deps"]), f"{name}: add to deps: {sorted(needed - set(stage['deps']))}"


def test_every_default_variant_student_and_the_ensemble_are_registered_models():
    dvc_yaml = yaml.safe_load((REPO_ROOT / "dvc.yaml").read_text())
    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    variants = params["models"]
    students = params["distill"]["students"] if params["distill"]["enabled"] else {}
    artifacts = dvc_yaml["artifacts"]
    assert set(artifacts) == {*variants, *students, "ensemble"}
    outs = {out if isinstance(out, str) else next(iter(out)) for out in dvc_yaml["stages"]["export_ensemble"]["outs"]}
    assert artifacts["ensemble"]["path"] in outs  # the deployable ensemble
    for name in [*variants, *students]:
        assert_model_entry(name, artifacts[name])


def assert_model_entry(name: str, entry: dict) -> None:
    """A variant's or a student's registry entry: train@<name> and distill@<name> write models/<name>."""
    assert entry == {**entry, "path": f"models/{name}", "type": "model"}
    assert entry["desc"] and "mtbert" in entry["labels"]
