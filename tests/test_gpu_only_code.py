"""The code only a GPU runs (tests/test_cuda.py, bench/gpu.py), checked on the CPU where it can be: every call
it makes to a project function or class binds to that callee's signature, and every stand-in it patches in
takes what the function it replaces takes. A GPU test rotted once this way (its stand-in lacked a keyword
the loop had started to pass), unseen until the next GPU session; now a changed signature fails CI."""

from __future__ import annotations

import ast
import importlib
import inspect
from collections.abc import Iterator

import pytest

from tests.conftest import REPO_ROOT

GPU_ONLY = {"tests/test_cuda.py": "tests.test_cuda", "bench/gpu.py": "bench.gpu"}
PROJECT = ("mtbert", "stages", "tests", "bench")


def local_names(tree: ast.Module) -> set[str]:
    """Names bound inside functions (arguments, assignments, nested functions): a call to one of them is not
    a call to the module-level object of the same name."""
    names = set()
    for function in (node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)):
        for node in ast.walk(function):
            if node is not function and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return names


def project_callee(namespace: dict, func: ast.expr, local: set[str]):
    """The project function or class that `func(...)` or `module.func(...)` calls, or None."""
    if isinstance(func, ast.Name) and func.id not in local:
        target = namespace.get(func.id)
    elif (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id not in local
          and inspect.ismodule(namespace.get(func.value.id))):
        target = getattr(namespace[func.value.id], func.attr, None)
    else:
        return None
    if (inspect.isfunction(target) or inspect.isclass(target)) and target.__module__.split(".")[0] in PROJECT:
        return target
    return None


def parsed(path: str) -> tuple[ast.Module, dict]:
    """The file's syntax tree, and its module's namespace (importing it, as collection does, runs nothing)."""
    return ast.parse((REPO_ROOT / path).read_text(encoding="utf-8")), vars(importlib.import_module(GPU_ONLY[path]))


def project_calls(path: str) -> Iterator[tuple[int, object, ast.Call]]:
    """(line, callee, call) for every call in the file to a project function or class."""
    tree, namespace = parsed(path)
    local = local_names(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (callee := project_callee(namespace, node.func, local)) is not None:
            yield node.lineno, callee, node


def bind(callee, call: ast.Call) -> None:
    """Bind the call's arguments (placeholders) to the callee's signature; a TypeError says what does not fit.
    A call that unpacks (`*args`, `**kwargs`) is bound on what it names."""
    positional = [None for argument in call.args if not isinstance(argument, ast.Starred)]
    keywords = {keyword.arg: None for keyword in call.keywords if keyword.arg is not None}
    unpacks = len(positional) < len(call.args) or len(keywords) < len(call.keywords)
    signature = inspect.signature(callee)
    (signature.bind_partial if unpacks else signature.bind)(*positional, **keywords)


@pytest.mark.parametrize("path", GPU_ONLY)
def test_every_call_of_the_gpu_only_code_fits_its_callees_signature(path):
    calls = list(project_calls(path))
    assert len(calls) >= 10  # the walk finds the calls it should
    problems = []
    for line, callee, call in calls:
        try:
            bind(callee, call)
        except TypeError as error:
            problems.append(f"{path}:{line}: {callee.__module__}.{callee.__qualname__}: {error}")
    assert not problems, "\n".join(problems)


def stand_ins(path: str) -> Iterator[tuple[int, object, ast.FunctionDef]]:
    """(line, the replaced function, the stand-in's definition) for each `monkeypatch.setattr(module, "name",
    f)` whose `f` is a function defined in the same test."""
    tree, namespace = parsed(path)
    for test in (node for node in tree.body if isinstance(node, ast.FunctionDef)):
        nested = {node.name: node for node in ast.walk(test) if isinstance(node, ast.FunctionDef) and node is not test}
        for call in (node for node in ast.walk(test) if isinstance(node, ast.Call)):
            if not (isinstance(call.func, ast.Attribute) and call.func.attr == "setattr" and len(call.args) == 3):
                continue
            owner, name, replacement = call.args
            if (isinstance(owner, ast.Name) and inspect.ismodule(namespace.get(owner.id))
                    and isinstance(name, ast.Constant) and isinstance(replacement, ast.Name)
                    and replacement.id in nested):
                yield call.lineno, getattr(namespace[owner.id], name.value), nested[replacement.id]


def takes_what_it_replaces(real, stand_in: ast.FunctionDef) -> list[str]:
    """The parameters of `real` that `stand_in` would refuse, were a caller to pass them."""
    arguments = stand_in.args
    positional = [a.arg for a in (*arguments.posonlyargs, *arguments.args)]
    named = {*positional, *(a.arg for a in arguments.kwonlyargs)}
    refused = []
    for index, parameter in enumerate(inspect.signature(real).parameters.values()):
        if parameter.kind is parameter.VAR_POSITIONAL:
            taken = arguments.vararg is not None
        elif parameter.kind is parameter.VAR_KEYWORD:
            taken = arguments.kwarg is not None
        elif parameter.kind is parameter.POSITIONAL_ONLY:
            taken = index < len(positional) or arguments.vararg is not None
        else:  # by name, or into **kwargs
            taken = parameter.name in named or arguments.kwarg is not None
        if not taken:
            refused.append(str(parameter))
    return refused


def test_every_stand_in_the_gpu_only_tests_patch_in_takes_what_the_real_function_takes():
    found = list(stand_ins("tests/test_cuda.py"))
    assert found  # the NCCL test patches init_ranks and all_reduce
    problems = [f"tests/test_cuda.py:{line}: {stand_in.name} does not take {', '.join(missing)}"
                for line, real, stand_in in found if (missing := takes_what_it_replaces(real, stand_in))]
    assert not problems, "\n".join(problems)
