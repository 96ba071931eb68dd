"""Where the stages read and write a variant's data by default, in one place so that the stages and
dvc.yaml agree.

Each variant may have its own encoder (`models.<v>.model.name`), so `tokenize@<v>` and `pretrain@<v>` write
per variant: data/tokenized/<v>/ (its encoder's token ids of every split, and rejects.tsv) and
models/pretrained/<v>/. The rows, ids and labels are the same in every variant's folder: a variant cannot
change `data` or `tasks`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mtbert.runtime import UserError

TOKENIZED = "data/tokenized/{variant}"
PRETRAINED = "models/pretrained/{variant}"
DATA_METRICS = "metrics/data/{variant}.json"
PRETRAIN_METRICS = "metrics/pretrain/{variant}.json"
PRETRAIN_LIVE = "metrics/pretrain/{variant}"
PRETRAIN_CHECKPOINTS = "checkpoints/pretrain/{variant}"
REJECTS_FILE = "rejects.tsv"


def of_variant(template: str, variant: str | None, given: Path | None = None) -> Path:
    """`given` where a command was given the path, else the template's path for the variant."""
    if given is not None:
        return given
    if variant is None:
        raise UserError(f"no variant: give --variant (a key of `models:` in params.yaml), or the path "
                        f"({template.format(variant='<variant>')})")
    return Path(template.format(variant=variant))


def run_every_variant(module: str, params_file: Path, variants) -> None:
    """`python -m <module> --variant <v>` for each variant in turn: a per-variant stage run by hand, or by a
    runner without DVC, with no variant named. Each prints its own error; the first failure stops."""
    for variant in variants:
        command = [sys.executable, "-m", module, "--variant", variant, "--params-file", str(params_file)]
        if subprocess.run(command).returncode != 0:
            raise UserError(f"{module} --variant {variant} failed (its error is above)")


def tokenized_of(variant: str | None, given: Path | None = None) -> Path:
    return of_variant(TOKENIZED, variant, given)


def pretrained_of(variant: str | None, given: Path | None = None) -> Path:
    return of_variant(PRETRAINED, variant, given)


def rejects_of(tokenized: Path, given: Path | None = None) -> Path:
    """The rows `tokenize` rejected, with why: `given`, else rejects.tsv in the tokenized folder."""
    return given or tokenized / REJECTS_FILE


def shared_rows(variants, given: Path | None = None) -> Path:
    """A tokenized folder for the stages that read the rows, ids and labels, never token ids (ensemble,
    stats): every variant's has the same ones, so the first variant's."""
    return tokenized_of(sorted(variants)[0], given)
