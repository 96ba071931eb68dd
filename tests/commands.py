"""`mtbert` commands run inside the test's own process, where a second interpreter is not the point.

A subprocess of the PyTorch engine spends seconds importing torch, transformers and scipy before it reads
its first argument; the suite ran dozens of them only to read an error message or an output. In-process,
typer's test runner calls the same command function with the same arguments; what the installed command
adds around it is `run_app` (mtbert/runtime.py), which prints a UserError as `error: <message>` and exits
with 1. The result here stands in for that: a UserError comes back as exit status 1 and that line, after
whatever the command wrote to stderr. The printing itself stays checked on real processes: every test
file that uses this keeps subprocess runs of the same command beside it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path


def mtbert_in_process(*args: str | Path, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    """`mtbert <args>` run here; stdout and stderr as text, as `subprocess.run(..., text=True)` gives them."""
    from typer.testing import CliRunner

    from mtbert.cli import app
    from mtbert.runtime import UserError

    arguments = [str(argument) for argument in args]
    result = CliRunner().invoke(app, arguments, input=stdin)
    error = result.exception
    if isinstance(error, UserError):
        return subprocess.CompletedProcess(arguments, 1, result.stdout, f"{result.stderr}error: {error}\n")
    if error is not None and not isinstance(error, SystemExit):
        raise error  # a bug, not a user's error: its traceback, as under MTBERT_DEBUG
    return subprocess.CompletedProcess(arguments, result.exit_code, result.stdout, result.stderr)
