"""The docs' references into the code stay true."""

from __future__ import annotations

import re

from tests.conftest import REPO_ROOT

# e.g. "`update` (`mtbert/training/finetune.py` line 171)" or "`Objective.__call__` (`…/losses.py` line 166)"
LINE_REFERENCE = re.compile(r"`(?P<name>[\w.]+)`\s+\(`(?P<file>[\w/]+\.py)`\s+line\s+(?P<line>\d+)\)")


def test_line_references_in_the_training_page_point_at_the_functions_they_name():
    text = (REPO_ROOT / "docs" / "training.md").read_text(encoding="utf-8")
    references = list(LINE_REFERENCE.finditer(text))
    assert len(references) >= 4  # the walk through one optimiser step
    for reference in references:
        lines = (REPO_ROOT / reference["file"]).read_text(encoding="utf-8").splitlines()
        function = reference["name"].split(".")[-1]
        line = lines[int(reference["line"]) - 1]
        assert re.match(rf"\s*def {re.escape(function)}\(", line), \
            f"docs/training.md: {reference[0]} points at {line.strip()!r}; update its line number"


def test_the_knob_reference_is_the_one_the_schema_generates():
    from mtbert.params_reference import reference

    current = (REPO_ROOT / "docs" / "params.md").read_text(encoding="utf-8")
    assert current == reference(), "docs/params.md is stale: python -m mtbert.params_reference docs/params.md"


def test_every_knob_of_params_yaml_is_described_in_the_reference():
    import yaml

    text = (REPO_ROOT / "docs" / "params.md").read_text(encoding="utf-8")
    described = set(re.findall(r"^\| `([^`]+)` \|", text, flags=re.M))

    def keys(node: dict, prefix: str):  # a mapping without a row of its own is a section: its keys have rows
        for key, value in node.items():
            dotted = f"{prefix}{key}"
            if isinstance(value, dict) and dotted not in described:
                yield from keys(value, f"{dotted}.")
            else:
                yield dotted

    raw = yaml.safe_load((REPO_ROOT / "params.yaml").read_text(encoding="utf-8"))
    raw = {name: section for name, section in raw.items() if name not in ("tasks", "heads", "models")}
    missing = [key for key in keys(raw, "") if key not in described]
    assert not missing, f"params.yaml keys without a row in docs/params.md: {missing}"
    assert "| `tasks.<task>.kind` |" in text and "| `heads.<task>.pooling` |" in text


def documented_set_params() -> list[tuple[str, list[str]]]:
    """Every `dvc exp run` command in the README's and topic pages' shell blocks: (where, its -S values)."""
    import shlex

    pages = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    commands = []
    for page in pages:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                if words[:3] == ["dvc", "exp", "run"]:
                    values = [value for flag, value in zip(words, words[1:], strict=False)
                              if flag in ("-S", "--set-param")]
                    commands.append((f"{page.name}: {line.strip()}", values))
    return commands


def test_every_documented_experiment_gives_valid_params(tmp_path):
    """Each documented `dvc exp run -S …`, applied to params.yaml by DVC's own code (what `dvc exp run` does
    first), gives params every stage accepts: a renamed knob fails here, not in a user's terminal."""
    from dvc.utils.hydra import apply_overrides

    from mtbert.params_file import load_params, variant_params

    commands = documented_set_params()
    assert any("+models.mpnet" in value for _, values in commands for value in values)  # the MPNet member
    for where, values in commands:
        params_file = tmp_path / "params.yaml"
        params_file.write_bytes((REPO_ROOT / "params.yaml").read_bytes())
        apply_overrides(params_file, values)
        for variant in load_params(params_file).models:
            variant_params(params_file, variant)  # raises, naming the key, where a value is refused
        assert values == [] or params_file.read_bytes() != (REPO_ROOT / "params.yaml").read_bytes(), where


def test_the_recipes_page_example_is_a_recipe_every_stage_accepts(tmp_path):
    """docs/recipes.md's example, saved as recipes/<name>.yaml as the page says, passes the check
    `python -m mtbert.recipes` makes before DVC runs (the backbone lookup aside: MPNet is optional here)."""
    from mtbert.recipes import check_params, load_recipe

    page = (REPO_ROOT / "docs" / "recipes.md").read_text(encoding="utf-8")
    example = page.split("## Writing a recipe", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "example.yaml").write_text(example, encoding="utf-8")
    backbones = check_params(load_recipe("example", tmp_path), REPO_ROOT / "params.yaml")
    assert backbones["mpnet"] == "sentence-transformers/all-mpnet-base-v2" and {"base", "stscross"} <= set(backbones)


def test_the_serving_page_lists_the_statuses_the_openapi_document_lists():
    from mtbert.deploy.schema import ERRORS, RETRY_AFTER_STATUSES

    text = (REPO_ROOT / "docs" / "serving.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| (\d{3}(?:, \d{3})*)( \+ `Retry-After`)? \|", text, flags=re.M)
    documented = {int(status) for statuses, _ in rows for status in statuses.split(", ")}
    # 499 is how /metrics counts a client that hung up, never an answer; 405 is Starlette's, for any route
    assert documented == set(ERRORS) - {499} | {405}, "docs/serving.md's status table and schema.ERRORS differ"
    with_retry = {int(statuses) for statuses, retry in rows if retry}
    assert with_retry == set(RETRY_AFTER_STATUSES)
