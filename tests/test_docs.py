"""The docs' references into the code stay true."""

from __future__ import annotations

import re

from tests.conftest import REPO_ROOT

# e.g. "`step` (`mtbert/training/finetune.py` line 349)" or "`Objective.__call__` (`…/objective.py` line 106)"
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
