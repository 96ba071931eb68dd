"""Shared fixtures: tiny CS224N-format files written per test, and the real packaged tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# No test may reach for the Hugging Face hub; set before transformers is imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BACKBONE = "sentence-transformers/all-MiniLM-L6-v2"

# Minimal valid copies of the nine files, in the quirks of the real ones (unnamed index column, the
# SST test header "0<TAB><TAB>id<TAB>sentence", float-string QQP labels, leading spaces in SST text).
RAW_FILES = {
    "ids-sst-train.csv": "\tid\tsentence\tsentiment\n"
                         "0\ts1\t It 's a -LRB- lovely -RRB- film .\t3\n"
                         "1\ts2\t A `` dull '' mess .\t0\n"
                         "2\ts3\t Fine .\t2\n",
    "ids-sst-dev.csv": "\tid\tsentence\tsentiment\n0\tsd1\t Great fun .\t4\n1\tsd2\t Bad .\t1\n",
    "ids-sst-test-student.csv": "0\t\tid\tsentence\n1\t0.0\tst1\t Odd .\n2\t1.0\tst2\t Sweet .\n",
    "quora-train.csv": "\tid\tsentence1\tsentence2\tis_duplicate\n"
                       "10\tq1\tHow do I cook rice?\tWhat is the way to cook rice?\t1.0\n"
                       "11\tq2\t\"\"\"Quoted\"\" words?\"\tWhy is the sky blue?\t0.0\n",
    "quora-dev.csv": "\tid\tsentence1\tsentence2\tis_duplicate\n12\tqd1\tIs it cold?\tIs it warm?\t0.0\n",
    "quora-test-student.csv": "\tid\tsentence1\tsentence2\n13\tqt1\tWho am I?\tWhat am I?\n",
    "sts-train.csv": "\tid\tsentence1\tsentence2\tsimilarity\n"
                     "1\tt1\tA dog runs.\tA dog is running.\t4.6\n"
                     "2\tt2\tA man sings.\tA cat sleeps.\t0.0\n",
    "sts-dev.csv": "\tid\tsentence1\tsentence2\tsimilarity\n3\ttd1\tA boy eats.\tA child eats.\t3.8\n",
    "sts-test-student.csv": "\tid\tsentence1\tsentence2\n4\ttt1\tTwo dogs play.\tDogs are playing.\n",
}


def write_raw_files(directory: Path, overrides: dict[str, str | bytes] | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in {**RAW_FILES, **(overrides or {})}.items():
        path = directory / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
    return directory


@pytest.fixture
def raw_dir(tmp_path: Path) -> Path:
    return write_raw_files(tmp_path / "raw")


@pytest.fixture(scope="session")
def tokenizer():
    from stages.core.backbone import load_tokenizer

    return load_tokenizer(DEFAULT_BACKBONE)
