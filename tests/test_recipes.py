"""Named recipes (mtbert/recipes.py): recipes/<name>.yaml checked against params.yaml before one `dvc exp run`.
The run itself, in a temporary repository, is in tests/test_pipeline.py."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from mtbert.model.packaged import BackboneError
from mtbert.params_file import load_params, variant_params
from mtbert.recipes import RecipeError, app, apply_recipe, check_params, exp_run_command, load_recipe
from tests.conftest import REPO_ROOT, make_params

MPNET = "sentence-transformers/all-mpnet-base-v2"


def write_recipe(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.yaml").write_text(text, encoding="utf-8")
    return folder


def recipe_of(folder: Path, name: str, overrides: list[str]) -> Path:
    return write_recipe(folder, name, yaml.safe_dump({"description": "a test's", "overrides": overrides}))


def test_the_best_recipe_adds_the_split_half_pool_to_the_default(tmp_path):
    """recipes/best.yaml on the shipped params.yaml: the default's two members and the eight MPNet members
    whose uniform average had the best split-half estimate, each a different run of all-mpnet-base-v2."""
    applied = tmp_path / "params.yaml"
    apply_recipe(load_recipe("best", REPO_ROOT / "recipes"), REPO_ROOT / "params.yaml", applied)
    params = load_params(applied)
    assert list(params.models)[:2] == ["base", "stscross"] and len(params.models) == 10
    assert params.ensemble.method == "uniform"
    assert params.runtime.malloc_threshold_mb == 16  # as the MPNet members' times were measured
    runs = set()
    for variant in list(params.models)[2:]:
        member = variant_params(applied, variant)  # raises, naming the key, where a stage would refuse it
        assert member.model.name == MPNET
        runs.add((member.train.lr, member.train.seed, member.train.layer_decay))
    assert len(runs) == 8  # no member is another's twin
    def comments(path: Path) -> list[str]:
        return [line.split("#", 1)[1] for line in path.read_text(encoding="utf-8").splitlines() if "#" in line]

    assert comments(applied) == comments(REPO_ROOT / "params.yaml") != []  # DVC's rewrite keeps every comment


def test_the_student_recipe_is_the_best_one_plus_a_student_exported_on_its_own(tmp_path):
    best, student = tmp_path / "best.yaml", tmp_path / "student.yaml"
    apply_recipe(load_recipe("best", REPO_ROOT / "recipes"), REPO_ROOT / "params.yaml", best)
    apply_recipe(load_recipe("best-student", REPO_ROOT / "recipes"), REPO_ROOT / "params.yaml", student)
    params, of_best = load_params(student), load_params(best)
    assert params.models == of_best.models and params.ensemble == of_best.ensemble
    assert params.distill.enabled and params.distill.variant == "base" and params.export.models == ["distilled"]
    assert list(params.distill.students) == ["distilled"]  # the name export.models deploys


def test_a_recipe_file_that_is_not_one_is_refused_naming_it(tmp_path):
    folder = write_recipe(tmp_path / "recipes", "good", "description: d\noverrides: [train.lr=1.0e-5]\n")
    with pytest.raises(RecipeError, match=r"recipes/nope\.yaml: no such recipe \(recipes in .*: good\)"):
        load_recipe("nope", folder)
    write_recipe(folder, "keys", "description: d\noverrides: [train.lr=1.0e-5]\nseeds: 3\n")  # a key it ignores
    with pytest.raises(RecipeError, match=r"keys\.yaml: expected the keys description and overrides \(and "
                                          r"optionally extends\), found \['description', 'overrides', 'seeds'\]"):
        load_recipe("keys", folder)
    write_recipe(folder, "empty", "description: d\noverrides: []\n")
    with pytest.raises(RecipeError, match=r"empty\.yaml: overrides: expected a non-empty list"):
        load_recipe("empty", folder)
    write_recipe(folder, "number", "description: d\noverrides: [train.lr=1.0e-5, 3]\n")
    with pytest.raises(RecipeError, match=r"number\.yaml: overrides\[1\]: expected an override .*found 3"):
        load_recipe("number", folder)


def test_a_recipe_that_extends_another_runs_its_overrides_first(tmp_path):
    folder = recipe_of(tmp_path / "recipes", "parent", ["+models.seed1={train: {seed: 1}}", "ensemble.method=greedy"])
    write_recipe(folder, "child", "description: d\nextends: parent\noverrides: [ensemble.method=uniform]\n")
    write_recipe(folder, "grandchild", "description: d\nextends: child\noverrides: [distill.enabled=true]\n")
    assert load_recipe("grandchild", folder).overrides == [
        "+models.seed1={train: {seed: 1}}", "ensemble.method=greedy", "ensemble.method=uniform",
        "distill.enabled=true"]


@pytest.mark.parametrize(("extends", "message"), [
    ("nope", r"recipes/nope\.yaml: no such recipe"),
    ("loop", r"loop\.yaml: extends: loop -> loop is a loop"),
    ("[a, b]", r"loop\.yaml: extends: expected the name of another recipe in .*, found \['a', 'b'\]"),
])
def test_a_recipe_that_extends_a_missing_recipe_or_itself_is_refused_in_one_line(tmp_path, extends, message):
    folder = write_recipe(tmp_path / "recipes", "loop", f"description: d\nextends: {extends}\noverrides: [a=1]\n")
    with pytest.raises(RecipeError, match=message) as error:
        load_recipe("loop", folder)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(("override", "message"), [
    ("train.lr=[1,", r"overrides\[1\] 'train.lr=\[1,': no viable alternative"),  # not Hydra's grammar
    ("train.no_such_knob=1", r"overrides\[1\] 'train.no_such_knob=1': Could not override"),  # a key without `+`
    ("train.lr=-1", r"params.yaml with .*bad\.yaml: train.lr: expected greater than 0, got -1"),  # a value
    ("+models.extra={train: {epochs: zero}}", r"with .*bad\.yaml: models.extra.train.epochs: expected"),
])
def test_a_bad_override_fails_before_dvc_runs_naming_the_recipe_and_the_override_or_key(
        tmp_path, tiny_backbone, override, message):
    params_file = make_params(tmp_path, tiny_backbone, tmp_path / "raw")
    folder = recipe_of(tmp_path / "recipes", "bad", ["ensemble.method=greedy", override])
    before = params_file.read_bytes()
    with pytest.raises(RecipeError, match=message) as error:
        check_params(load_recipe("bad", folder), params_file)
    assert "\n" not in str(error.value)
    assert params_file.read_bytes() == before  # only a copy is ever changed


def run_recipes(*args: str):
    return CliRunner().invoke(app, list(args))


def test_a_member_whose_backbone_is_missing_fails_before_dvc_runs(tmp_path, tiny_backbone, monkeypatch):
    params_file = make_params(tmp_path, tiny_backbone, tmp_path / "raw")
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    folder = recipe_of(tmp_path / "recipes", "r", [f"+models.big={{model: {{name: {empty}}}}}"])
    monkeypatch.setattr("mtbert.recipes.subprocess.run", lambda *a, **k: pytest.fail("DVC ran"))
    result = run_recipes("r", "--recipes-dir", str(folder), "--params-file", str(params_file))
    assert isinstance(result.exception, BackboneError)
    assert re.search(r"not-a-model.* is a directory without config\.json", str(result.exception))


def test_apply_writes_the_recipe_into_params_yaml_for_make_members(tmp_path, tiny_backbone, monkeypatch):
    params_file = make_params(tmp_path, tiny_backbone, tmp_path / "raw")
    folder = recipe_of(tmp_path / "recipes", "r", ["+models.seed1={train: {seed: 1}}"])
    monkeypatch.setattr("mtbert.recipes.subprocess.run", lambda *a, **k: pytest.fail("DVC ran"))
    result = run_recipes("r", "--apply", "--recipes-dir", str(folder), "--params-file", str(params_file))
    assert result.exit_code == 0, result.output
    assert list(load_params(params_file).models) == ["base", "seed1"]
    assert variant_params(params_file, "seed1").train.seed == 1
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".recipe-")) == []  # no leftovers


def test_the_dry_run_prints_the_experiment_it_would_run_and_runs_nothing(tmp_path, tiny_backbone, monkeypatch):
    params_file = make_params(tmp_path, tiny_backbone, tmp_path / "raw")
    overrides = ["+models.seed1={train: {seed: 1}}", "ensemble.method=greedy"]
    folder = recipe_of(tmp_path / "recipes", "two", overrides)
    monkeypatch.setattr("mtbert.recipes.subprocess.run", lambda *a, **k: pytest.fail("the dry run ran DVC"))
    result = run_recipes("two", "--dry-run", "--name", "trial", "--recipes-dir", str(folder),
                         "--params-file", str(params_file))
    assert result.exit_code == 0, result.output
    command = shlex.split(result.stdout.strip().splitlines()[-1])
    assert command == exp_run_command(load_recipe("two", folder), "trial", queue=False)
    assert command[:5] == ["dvc", "exp", "run", "--name", "trial"]
    assert command[5:] == [word for o in overrides for word in ("--set-param", o)]  # in the recipe's order


def test_a_recipe_applied_again_gives_the_same_params_so_a_stopped_make_best_resumes(tmp_path):
    """`dvc exp run -S` leaves params.yaml with the recipe applied when it is stopped; `make best` run again
    applies the recipe over it, which must check and give the same params, or the run could not resume."""
    recipe = load_recipe("best", REPO_ROOT / "recipes")
    once, twice = tmp_path / "once.yaml", tmp_path / "twice.yaml"
    apply_recipe(recipe, REPO_ROOT / "params.yaml", once)
    apply_recipe(recipe, once, twice)
    assert load_params(twice) == load_params(once)
    assert check_params(recipe, once) == check_params(recipe, REPO_ROOT / "params.yaml")
