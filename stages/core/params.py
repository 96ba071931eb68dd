"""The params.yaml schema and its validation.

params.yaml is the single source of every knob: the dataclasses below declare each key's type and
allowed range but carry no defaults, so a key missing from params.yaml is an error, as is a key the
schema does not know. Validation runs before a stage does any work and names the offending key.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

DEFAULT_PARAMS_FILE = Path("params.yaml")
TaskName = Literal["sst", "qqp", "sts"]


class ParamsError(ValueError):
    """A params.yaml key is unknown, missing or has a bad value."""


def _bounded(*, ge: float | None = None, gt: float | None = None, le: float | None = None,
             lt: float | None = None) -> Any:
    """A required dataclass field whose numeric value must lie in the given bounds."""
    return dataclasses.field(metadata={"ge": ge, "gt": gt, "le": le, "lt": lt})


@dataclasses.dataclass(frozen=True)
class DataParams:
    raw_dir: str
    max_reject_fraction: float = _bounded(ge=0.0, le=1.0)
    unescape_ptb: list[TaskName]  # tasks whose text has PTB escapes such as -LRB- to turn back


@dataclasses.dataclass(frozen=True)
class TokenizeParams:
    max_length: int = _bounded(ge=8, le=4096)
    batch_size: int = _bounded(ge=1)


@dataclasses.dataclass(frozen=True)
class ModelParams:
    name: str


@dataclasses.dataclass(frozen=True)
class Params:
    data: DataParams
    tokenize: TokenizeParams
    model: ModelParams


def load_params(path: Path | str = DEFAULT_PARAMS_FILE) -> Params:
    """Read and validate params.yaml; raise ParamsError naming the first bad key."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ParamsError(f"{path}: file not found (run from the repository root)") from None
    except yaml.YAMLError as error:
        raise ParamsError(f"{path}: not valid YAML: {error}") from None
    return parse_params(raw, source=str(path))


def parse_params(raw: Any, *, source: str = "params") -> Params:
    try:
        return _build(Params, raw, "")
    except ParamsError as error:
        raise ParamsError(f"{source}: {error}") from None


def as_dict(params: Any) -> dict[str, Any]:
    """Plain nested dict of a params dataclass, e.g. to save beside a model."""
    return dataclasses.asdict(params)


def _build(cls: type, raw: Any, key: str) -> Any:
    label = key or "the top level"
    if not isinstance(raw, dict):
        raise ParamsError(f"{label}: expected a mapping, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ParamsError(f"unknown key {_join(key, unknown[0])!r}; "
                          f"{label} accepts: {', '.join(fields)}")
    missing = [name for name in fields if name not in raw]
    if missing:
        raise ParamsError(f"missing key {_join(key, missing[0])!r}")
    values = {}
    for name, field in fields.items():
        full_key = _join(key, name)
        value = _convert(hints[name], raw[name], full_key)
        _check_bounds(field.metadata, value, full_key)
        values[name] = value
    return cls(**values)


def _convert(hint: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, key)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [arg for arg in args if arg is not type(None)]
        return _convert(inner[0], value, key)
    if origin is Literal:
        if value not in args:
            raise ParamsError(f"{key}: expected one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ParamsError(f"{key}: expected a list, got {value!r}")
        return [_convert(args[0], item, f"{key}[{i}]") for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ParamsError(f"{key}: expected a mapping, got {value!r}")
        return {k: _convert(args[1], v, _join(key, str(k))) for k, v in value.items()}
    return _convert_scalar(hint, value, key)


def _convert_scalar(hint: type, value: Any, key: str) -> Any:
    if hint is bool:
        if not isinstance(value, bool):
            raise ParamsError(f"{key}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ParamsError(f"{key}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ParamsError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str) or not value:
            raise ParamsError(f"{key}: expected a non-empty string, got {value!r}")
        return value
    raise TypeError(f"params schema: unsupported type {hint!r} for {key}")


_COMPARISONS = {"ge": (operator.ge, ">="), "gt": (operator.gt, ">"),
                "le": (operator.le, "<="), "lt": (operator.lt, "<")}


def _check_bounds(metadata: typing.Mapping[str, Any], value: Any, key: str) -> None:
    if value is None:
        return
    for name, (compare, symbol) in _COMPARISONS.items():
        bound = metadata.get(name)
        if bound is not None and not compare(value, bound):
            raise ParamsError(f"{key}: expected a value {symbol} {bound}, got {value!r}")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
