"""Reading params.yaml: the YAML, its validation against the schema (mtbert/params.py) with one-line errors,
and the params of one variant or distilled student (its overrides merged by mtbert/variants.py).

An error names the file and the dotted key as the user wrote it, from pydantic's location of the first error
(unknown keys first, then missing ones): `params.yaml: train.batch_size.sst: expected ...`.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from ruamel.yaml import YAML, YAMLError

from mtbert.params import DistillParams, Params, ParamsError, Section
from mtbert.per_task import NAME
from mtbert.variants import deep_merge, merged_variant

DEFAULT_PARAMS_FILE = Path("params.yaml")


def load_params(path: Path | str = DEFAULT_PARAMS_FILE) -> Params:
    """Read and validate params.yaml; raise ParamsError naming the first bad key."""
    return parse_params(read_yaml(Path(path)), source=str(path))


def read_yaml(path: Path) -> Any:
    """params.yaml's content as DVC reads it: YAML 1.2 (ruamel.yaml, DVC's own parser). PyYAML reads YAML 1.1,
    in which `5e-05`, the way `dvc exp run -S train.lr=5e-5` writes a number, is a string.

    ruamel.yaml parses with its C parser (ruamel.yaml.clib, as DVC's own reads do where it is installed), far
    faster than its pure-Python one. A file it refuses is parsed again in Python for the error alone, whose message
    says what was found where (`expected ',' or ']', but got ':'`), not only what was missing."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ParamsError(f"{path}: file not found (run from the repository root)") from None
    try:
        return YAML(typ="safe").load(text)
    except YAMLError as error:
        raise ParamsError(f"{path}: not valid YAML{yaml_error(text, error)}") from None


def yaml_error(text: str, error: YAMLError) -> str:
    """Where and why `text` is not valid YAML, in one line: the pure-Python parser's words for it where it
    refuses the text too."""
    try:
        YAML(typ="safe", pure=True).load(text)
    except YAMLError as pure_error:
        error = pure_error
    mark = getattr(error, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = getattr(error, "problem", None) or str(error)
    return f"{where}: {' '.join(problem.split())}"


def parse_params(raw: Any, *, source: str = "params") -> Params:
    """params.yaml's content validated, and every variant's too."""
    params = parse_section(Params, raw, "", source=source)
    for variant in params.models:
        if not NAME.fullmatch(variant) or variant == "ensemble":
            raise ParamsError(f"{source}: models.{variant}: a variant name may use letters, digits, '_' and '-', "
                              "and cannot be 'ensemble'")
        parse_section(Params, merged_variant(raw, variant), f"models.{variant}", source=source)
    return params


def parse_section(cls: type[Section], raw: Any, key: str, *, source: str = "params") -> Any:
    """`raw` validated as `cls`, e.g. a whole params file or a saved model's ModelSpec; errors start with
    `<source>: <key>.`."""
    tasks = list(raw["tasks"]) if isinstance(raw, dict) and isinstance(raw.get("tasks"), dict) else []
    try:
        # params.yaml says `lambda`, never `lambda_`
        return cls.model_validate(raw, context={"tasks": tasks}, by_alias=True, by_name=False)
    except ValidationError as error:
        raise ParamsError(f"{source}: {one_line(error, cls, key, raw)}") from None


def with_changes(section: Section, **changes: Any) -> Any:
    """A copy of a section with some knobs changed (by field name, e.g. `lambda_`), validated again. A
    per-task knob takes its resolved form here, {task: value} for every task."""
    try:
        raw = {**dict(section), **changes}
        return type(section).model_validate(raw, by_name=True)
    except ValidationError as error:
        raise ParamsError(one_line(error, type(section), "", raw)) from None


def variant_params(raw_or_path: Any, variant: str) -> Params:
    """The params of one named variant: its overrides deep-merged over the shared sections."""
    raw, source = raw_or_path, "params"
    if isinstance(raw_or_path, (str, Path)):
        raw, source = read_yaml(Path(raw_or_path)), str(raw_or_path)
    parse_params(raw, source=source)
    return parse_section(Params, merged_variant(raw, variant), f"models.{variant}", source=source)


def student_params(params_file: Path | str, student: str) -> Params:
    """The params of one distilled student: distill.variant's with the student's seed (distill.students)."""
    raw = read_yaml(Path(params_file))
    distill = parse_params(raw, source=str(params_file)).distill
    require_student(distill, student, params_file)
    merged = deep_merge(merged_variant(raw, distill.variant), {"train": {"seed": distill.students[student]}})
    return parse_section(Params, merged, f"distill.students.{student}", source=str(params_file))


def require_student(distill: DistillParams, student: str, source: Path | str) -> None:
    if student not in distill.students:
        raise ParamsError(f"{source}: distill.students: no student {student!r}; it names "
                          f"{', '.join(distill.students)}")


def one_line(error: ValidationError, root: type[Section], key: str, raw: Any) -> str:
    """pydantic's first error (unknown keys first, then missing ones) as one line naming the dotted key as the
    user wrote it: a per-task knob given one value for every task is named without a task."""
    first = min(error.errors(), key=lambda e: {"extra_forbidden": 0, "missing": 1}.get(e["type"], 2))
    loc = [str(part) for part in first["loc"]]
    if len(first["loc"]) > 1 and isinstance(first["loc"][-1], str) and written_as_one_value(raw, loc[:-1]):
        loc = loc[:-1]  # every_task spread this one value over the tasks
    name = ".".join(filter(None, [key, *loc]))
    if first["type"] == "extra_forbidden":
        accepted = [field.alias or field_name for field_name, field in section_at(root, loc[:-1]).model_fields.items()]
        parent = ".".join(filter(None, [key, *loc[:-1]])) or "the top level"
        return f"unknown key {name!r}; {parent} accepts: {', '.join(accepted)}"
    if first["type"] == "missing":
        return f"missing key {name!r}"
    if first["type"] == "value_error":  # a validator's message: `<key within name>: …`, or `: …` about name itself
        message = str(first["ctx"]["error"])
        return f"{name}{message}" if message.startswith(":") else ".".join(filter(None, [name, message]))
    message = "expected a mapping" if first["type"] == "model_type" else first["msg"]
    if message.startswith("Input should be "):
        message = "expected " + message.removeprefix("Input should be ")
    return f"{name or 'the top level'}: {message[0].lower()}{message[1:]}, got {first['input']!r:.80}"


def written_as_one_value(raw: Any, loc: list[str]) -> bool:
    """Whether the raw input at a path of keys is there and not a mapping."""
    for part in loc:
        if not isinstance(raw, dict) or part not in raw:
            return False
        raw = raw[part]
    return not isinstance(raw, dict)


def section_at(root: type[Section], loc: list[str]) -> type[Section]:
    """The section class at a path of keys: a model's field, or a mapping's value."""
    section: Any = root
    for part in loc:
        section = (typing.get_args(section)[1] if typing.get_origin(section) is dict
                   else section.model_fields[part].annotation)
    return section
