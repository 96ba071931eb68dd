"""The import graph: no module of mtbert/ imports from a layer above its own, at the top of the file or
inside a function (a hidden tie is still a tie). The runtime (mtbert/deploy/: engines, server) sits right
above the base and imports no torch, so an export is served without PyTorch; the export that writes its
graphs (mtbert/export/) sits above training and evaluation."""

import ast
from pathlib import Path

from tests.conftest import REPO_ROOT

# lowest first; a module belongs to the longest prefix that names it
LAYERS = {
    "base": ("mtbert.runtime", "mtbert.io", "mtbert.integrity", "mtbert.inputs", "mtbert.params",
             "mtbert.params_file", "mtbert.per_task", "mtbert.variants", "mtbert.rng", "mtbert.layout"),
    "runtime": ("mtbert.deploy",),
    "data": ("mtbert.data",),
    "model": ("mtbert.model",),
    "learning": ("mtbert.training", "mtbert.evaluation"),
    "export": ("mtbert.export",),
    "commands": ("mtbert",),  # inference, predictors, cli, members, offline_plots, params_reference
}


def layer_of(module: str) -> int:
    matches = [(len(prefix), rank) for rank, prefixes in enumerate(LAYERS.values()) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    return max(matches)[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> list[tuple[str, int]]:
    """Every module the file imports, anywhere in it, with the line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names] if node.module == "mtbert" else []
            found += [(name, node.lineno) for name in names or [node.module]]
        elif isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
    return found


def test_no_module_imports_from_a_layer_above_its_own():
    names = list(LAYERS)
    upward = []
    for path in sorted((REPO_ROOT / "mtbert").rglob("*.py")):
        module = module_name(path)
        for target, line in imported(path):
            if target.startswith("mtbert") and layer_of(target) > layer_of(module):
                upward.append(f"{path.relative_to(REPO_ROOT)}:{line} ({names[layer_of(module)]}) imports "
                              f"{target} ({names[layer_of(target)]})")
    assert not upward, "\n".join(upward)


def test_the_runtime_imports_no_torch():
    heavy = [f"{path.relative_to(REPO_ROOT)}:{line} imports {target}"
             for path in sorted((REPO_ROOT / "mtbert" / "deploy").rglob("*.py"))
             for target, line in imported(path) if target.split(".")[0] in ("torch", "transformers")]
    assert not heavy, "\n".join(heavy)
