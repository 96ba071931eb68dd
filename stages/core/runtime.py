"""Process-wide setup shared by the stage commands."""

from __future__ import annotations

import logging
import os


def setup_logging(level: str | None = None) -> None:
    """Timestamped log lines on stderr, so a long stage always says what it is doing."""
    logging.basicConfig(level=level or os.environ.get("MTBERT_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
