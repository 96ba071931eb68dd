"""Process-wide setup shared by the stage commands."""

from __future__ import annotations

import logging
import os


def setup_logging(level: str | None = None) -> None:
    """Timestamped log lines on stderr, so a long stage always says what it is doing."""
    logging.basicConfig(level=level or os.environ.get("MTBERT_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", datefmt="%H:%M:%S")


def setup_torch(seed: int, threads: int):
    """Seed torch, set CPU threads (0 keeps torch's default) and pick the device."""
    import torch

    torch.manual_seed(seed)
    if threads:
        torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
