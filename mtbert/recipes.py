"""A named recipe as one DVC experiment: `python -m mtbert.recipes best` (`make best`) runs recipes/best.yaml.

A recipe is a list of `dvc exp run -S` overrides (Hydra's override grammar), so its run is an ordinary
experiment: `dvc exp show` lists it beside the others and `dvc metrics diff` compares it. params.yaml stays
the one file a user edits. DVC's Hydra composition (`hydra.enabled`, conf/ groups) would name recipes too,
but it writes params.yaml anew from conf/ at every `dvc exp run`, without its comments and without any edit
made in params.yaml itself.

Before DVC starts, the overrides are applied to a copy of params.yaml by DVC's own code, every variant is
validated, and every backbone is looked up offline: a mistake fails in one line, not hours into a run.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import typer

from mtbert.params_file import DEFAULT_PARAMS_FILE, load_params, read_yaml, variant_params
from mtbert.runtime import UserError, run_app, setup_logging

RECIPES_DIR = Path("recipes")
RECIPE_KEYS = {"description", "overrides", "extends"}  # the first two required
log = logging.getLogger("recipes")
app = typer.Typer(add_completion=False)


class RecipeError(UserError, ValueError):
    """A recipe file is missing or malformed, or its overrides give params a stage would refuse."""


@dataclass(frozen=True)
class Recipe:
    path: Path
    description: str
    overrides: list[str]


def load_recipe(name: str, folder: Path = RECIPES_DIR, _chain: tuple[str, ...] = ()) -> Recipe:
    """recipes/<name>.yaml: a `description`, a non-empty list of `overrides`, each a string, and optionally
    `extends: <recipe>`, whose overrides go first."""
    path = folder / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in folder.glob("*.yaml"))) or "none"
        raise RecipeError(f"{path}: no such recipe (recipes in {folder}: {known})")
    raw = read_yaml(path)
    if not isinstance(raw, dict) or not {"description", "overrides"} <= set(raw) <= RECIPE_KEYS:
        found = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise RecipeError(f"{path}: expected the keys description and overrides (and optionally extends), "
                          f"found {found}")
    overrides = raw["overrides"]
    if not isinstance(overrides, list) or not overrides:
        raise RecipeError(f"{path}: overrides: expected a non-empty list of `dvc exp run -S` overrides")
    for index, override in enumerate(overrides):
        if not isinstance(override, str) or not override.strip():
            raise RecipeError(f"{path}: overrides[{index}]: expected an override such as train.lr=4.0e-5, "
                              f"found {override!r}")
    return Recipe(path, str(raw["description"]), inherited(raw.get("extends"), path, folder, (*_chain, name))
                  + overrides)


def inherited(parent, path: Path, folder: Path, chain: tuple[str, ...]) -> list[str]:
    """The overrides of the recipe that `path` extends (none if it extends none)."""
    if parent is None:
        return []
    if not isinstance(parent, str) or not parent.strip():
        raise RecipeError(f"{path}: extends: expected the name of another recipe in {folder}, found {parent!r}")
    if parent in chain:
        raise RecipeError(f"{path}: extends: {' -> '.join((*chain, parent))} is a loop")
    return load_recipe(parent, folder, chain).overrides


def apply_recipe(recipe: Recipe, params_file: Path, out: Path) -> None:
    """params_file with the recipe's overrides applied in order, as `dvc exp run -S` applies them (all in
    one call), written to `out` once all of them applied (`out` may be params_file itself)."""
    from dvc.exceptions import InvalidArgumentError
    from dvc.utils.hydra import apply_overrides

    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".recipe-") as folder:
        applied = Path(folder) / "params.yaml"  # DVC picks its YAML writer by the suffix
        applied.write_bytes(params_file.read_bytes())
        try:
            apply_overrides(applied, list(recipe.overrides))
        except InvalidArgumentError as error:
            applied.write_bytes(params_file.read_bytes())
            name_the_refused_override(recipe, applied)
            raise RecipeError(f"{recipe.path}: overrides: {cause_of(error)}") from None
        os.replace(applied, out)


def name_the_refused_override(recipe: Recipe, applied: Path) -> None:
    """The overrides applied to `applied` one at a time (each call rewrites the file, so only once the
    whole list was refused), raising a RecipeError naming the first one refused."""
    from dvc.exceptions import InvalidArgumentError
    from dvc.utils.hydra import apply_overrides

    for index, override in enumerate(recipe.overrides):
        try:
            apply_overrides(applied, [override])
        except InvalidArgumentError as error:
            raise RecipeError(f"{recipe.path}: overrides[{index}] {override!r}: {cause_of(error)}") from None


def cause_of(error: Exception) -> str:
    return " ".join(str(error.__cause__ or error).split())


def check_params(recipe: Recipe, params_file: Path) -> dict[str, str]:
    """Each variant of params_file once the recipe is applied, validated as its stages read it: its backbone."""
    with tempfile.TemporaryDirectory() as folder:
        applied = Path(folder) / "params.yaml"
        apply_recipe(recipe, params_file, applied)
        try:
            return {variant: variant_params(applied, variant).model.name for variant in load_params(applied).models}
        except UserError as error:  # the message names the temporary copy; name the files the user has
            raise RecipeError(str(error).replace(str(applied), f"{params_file} with {recipe.path}")) from None


def check_backbones(names: list[str]) -> None:
    """Each backbone's config found offline, as `tokenize` will look for it (make mpnet installs MPNet's)."""
    from mtbert.model.backbone import load_config

    for name in names:
        load_config(name)


def exp_run_command(recipe: Recipe, name: str | None, queue: bool) -> list[str]:
    command = ["dvc", "exp", "run"]
    if name:
        command += ["--name", name]
    if queue:
        command.append("--queue")
    for override in recipe.overrides:
        command += ["--set-param", override]
    return command


@app.command()
def main(recipe_name: str = typer.Argument("best", metavar="RECIPE", help="a file recipes/<RECIPE>.yaml"),
         name: str = typer.Option(None, "--name", "-n", help="the experiment's name (default: DVC's)"),
         queue: bool = typer.Option(False, "--queue", help="queue it (`dvc queue start` runs it) instead"),
         dry_run: bool = typer.Option(False, "--dry-run", help="check the recipe and print the command only"),
         apply: bool = typer.Option(False, "--apply", help="write the recipe into params.yaml and stop, e.g. "
                                    "for `make members` on a GPU"),
         recipes_dir: Path = typer.Option(RECIPES_DIR, "--recipes-dir"),
         params_file: Path = typer.Option(DEFAULT_PARAMS_FILE, "--params-file")) -> None:
    setup_logging()
    recipe = load_recipe(recipe_name, recipes_dir)
    backbones = check_params(recipe, params_file)
    check_backbones(sorted(set(backbones.values())))
    log.info("%s: %s; %d variants: %s", recipe.path, recipe.description, len(backbones), ", ".join(backbones))
    if apply:
        apply_recipe(recipe, params_file, params_file)
        log.info("%s now holds the recipe; `dvc repro` (or `make members` first, on a GPU) runs it", params_file)
        return
    command = exp_run_command(recipe, name, queue)
    print(shlex.join(command), flush=True)  # what runs, to replay or adapt by hand
    if dry_run:
        return
    # this interpreter first on PATH: the stages DVC runs (`python -m stages...`) are then this environment's
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    returncode = subprocess.run([sys.executable, "-m", *command], env=env).returncode
    if returncode != 0:
        raise UserError(f"{shlex.join(command)} failed (exit status {returncode}); run it again to resume: "
                        "finished stages are cached, and a killed training resumes from its checkpoint")


if __name__ == "__main__":
    run_app(app)
