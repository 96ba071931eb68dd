"""docs/params.md, the reference of every params.yaml knob, generated from the schema (mtbert/params.py):
`python -m mtbert.params_reference docs/params.md`. tests/test_docs.py checks that it is current."""

from __future__ import annotations

import sys
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import annotated_types
from pydantic.fields import FieldInfo

from mtbert.params import Params, Section

INTRO = """# params.yaml: every knob

Generated from `mtbert/params.py` by `python -m mtbert.params_reference docs/params.md`; a test checks that
it is current. `params.yaml` holds the values the pipeline runs with: only a key with a default here may be
left out of it. A per-task knob takes one value for every task, or `{task: value}` for some (the others get
the default). Validation, errors and variants: [training](training.md#params-validation-and-errors).
"""
BOUNDS = {annotated_types.Ge: ("ge", "≥"), annotated_types.Gt: ("gt", ">"), annotated_types.Le: ("le", "≤"),
          annotated_types.Lt: ("lt", "<")}


def reference() -> str:
    """Every section of params.yaml in file order: its docstring, then a table of its knobs."""
    lines = [INTRO]
    for name, field in Params.model_fields.items():
        section, per_task = field.annotation, typing.get_origin(field.annotation) is dict
        if per_task:
            section = typing.get_args(section)[1]
        if isinstance(section, type) and issubclass(section, Section):
            lines += section_lines(section, f"`{name}`" + (" (per task)" if per_task else ""),
                                   f"{name}.<task>." if per_task else f"{name}.", level="##")
        else:
            lines += [f"## `{name}`", "", field.description, ""]
    return "\n".join(lines).rstrip() + "\n"


def section_lines(section: type[Section], title: str, prefix: str, level: str) -> list[str]:
    """A section's heading, description and table; its nested sections follow, one level down."""
    lines = [f"{level} {title}", "", " ".join(section.__doc__.split()), "",
             "| key | type | default | what |", "|---|---|---|---|"]
    nested = []
    for field_name, field in section.model_fields.items():
        key = prefix + (field.alias or field_name)
        if isinstance(field.annotation, type) and issubclass(field.annotation, Section):
            nested.append((key, field.annotation))
            lines.append(f"| `{key}` | mapping | | {cell(field.description)} (below) |")
            continue
        default = "" if field.is_required() else f"`{'null' if field.default is None else field.default}`"
        lines.append(f"| `{key}` | {knob_type(field)} | {default} | {cell(field.description)} |")
    lines.append("")
    for key, nested_section in nested:
        lines += section_lines(nested_section, f"`{key}`", f"{key}.", level="###")
    return lines


def knob_type(field: FieldInfo) -> str:
    kind = field.annotation
    if typing.get_origin(kind) is dict and not field.is_required():  # a per-task knob
        return "per task: " + type_text(typing.get_args(kind)[1])
    return type_text(kind, field.metadata)


def type_text(kind: Any, metadata: list = ()) -> str:
    """A type as the table writes it, e.g. `int ≥ 1`, `'inf' \\| 'l2'`, `list of str`."""
    metadata = [inner for item in metadata for inner in (item.metadata if isinstance(item, FieldInfo) else [item])]
    bounds = " ".join(f"{BOUNDS[type(item)][1]} {getattr(item, BOUNDS[type(item)][0])}" for item in metadata
                      if type(item) in BOUNDS)
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is Annotated:
        return type_text(args[0], [*args[1:], *metadata])
    if origin is Literal:
        text = cell(" | ".join(repr(arg) for arg in args))
    elif origin in (typing.Union, types.UnionType):
        text = r" \| ".join("null" if arg is type(None) else type_text(arg) for arg in args)
    elif origin is dict:
        text = f"{{name: {type_text(args[1])}}}"
    elif origin is list:
        text = f"list of {type_text(args[0])}"
    else:
        text = kind.__name__
    return f"{text} {bounds}".strip()


def cell(text: str) -> str:
    """Text safe in a Markdown table cell."""
    return text.replace("|", r"\|")


if __name__ == "__main__":
    Path(sys.argv[1]).write_text(reference(), encoding="utf-8")
