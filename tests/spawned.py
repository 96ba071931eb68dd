"""Functions that tests run in spawned processes. A spawned child imports the module of the function it
runs; this one imports nothing heavy, so a child starts in a fraction of a second instead of loading
what a test module loads (torch, ONNX Runtime, the server)."""

from __future__ import annotations

import sys


def never_starts(sock, started) -> None:
    """A server worker that fails before it serves."""
    sys.exit(1)
