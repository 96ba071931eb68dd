"""Tasks are data: no code under stages/ names a task (they come from params.yaml's `tasks:`)."""

import ast

from tests.conftest import REPO_ROOT, TASKS


def test_no_code_under_stages_names_a_task():
    named = []
    for path in sorted((REPO_ROOT / "stages").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in TASKS:
                named.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} {node.value!r}")
    assert not named, "task names in code (declare them in params.yaml instead):\n" + "\n".join(named)
