"""Predictions on new text with a trained model or the ensemble: the engine of `mtbert predict`, and its
Python API.

    from mtbert.inference import Predictor, EnsemblePredictor
    predictor = Predictor.load("models/base")
    predictor.predict("sst", ["A gorgeous, witty film."])
    # [{'prob_0': 0.01, ..., 'prob_4': 0.62, 'label': 4}]
    predictor.predict("sts", [("A man plays a guitar.", "A man is playing music.")])
    # [{'score': 3.9, 'label': 3.9}]
    EnsemblePredictor.load("metrics/ensemble.json").predict("qqp", [("How do I cook rice?", "How to cook rice?")])

Texts go through the pipeline's own steps: the cleaning of `tokenize` (whitespace stripped, PTB escapes
undone for the tasks of `data.unescape_ptb`), the model folder's tokenizer with the same truncation
(`tokenize.max_length`, longest-first for pairs), length-sorted batches under `inference_mode`
(`predict_split`). So on the rows of a split, with the `predict` stage's batch size and precision, the
results are `predict`'s dumps bit for bit. A result holds the dump's columns: SST `prob_0`..`prob_4` and
`label`, QQP `prob` (of a paraphrase) and `label`, STS `score` (0-5) and `label` (the score).

This is the PyTorch engine, for a trained variant's folder; an exported one (`mtbert export`) runs on ONNX
Runtime without torch (mtbert/deploy/engine.py). The checks of the texts both share are in mtbert/inputs.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from mtbert.data.batches import TaskSplit, split_of_table
from mtbert.data.rawdata import clean_text
from mtbert.data.tasks import Task
from mtbert.data.tokenization import encode_rows
from mtbert.deploy.engine import is_export, load_export
from mtbert.deploy.members import MemberEnsemble
from mtbert.evaluation.evaluate import predict_split
from mtbert.inputs import InputError, Text, check_texts
from mtbert.model.backbone import load_tokenizer
from mtbert.model.saved import load_model, tokenizer_dir

__all__ = ["EnsemblePredictor", "InputError", "Predictor", "Text", "check_texts", "describe", "split_of"]


def split_of(table, task: Task) -> TaskSplit:
    """A tokenized table (as `encode_rows` makes it) as a TaskSplit, the way `load_split` reads its Parquet."""
    return split_of_table(table, task, np.full(table.num_rows, np.nan))


def describe(task: Task, values: np.ndarray) -> list[dict]:
    """One JSON-ready dict per row: the dump's value columns and the predicted label."""
    names = task.kind.value_columns()
    matrix = values.reshape(len(values), -1)
    labels = task.kind.predicted_labels(values)
    return [{**{name: float(value) for name, value in zip(names, row, strict=True)}, "label": label.item()}
            for row, label in zip(matrix, np.asarray(labels), strict=True)]


class Predictor:
    """A trained variant's folder, ready to predict any of its tasks on lists of texts."""

    def __init__(self, model, params: dict, tokenizer, *, batch_size: int = 128, bf16: bool = False,
                 device: str | torch.device = "cpu"):
        self.model, self.tokenizer = model, tokenizer
        self.tasks: dict[str, Task] = model.tasks
        self.max_length = params["tokenize"]["max_length"]
        self.unescape_ptb = set(params["data"]["unescape_ptb"])
        self.batch_size, self.bf16, self.device = batch_size, bf16, torch.device(device)
        self.model.to(self.device)

    @classmethod
    def load(cls, model_dir: Path | str, **options) -> Predictor:
        """From `models/<variant>/` (the tokenizer is the one saved with its encoder, loaded as `tokenize`
        loads the backbone's). An export (`exports/<variant>`, `exports/ensemble`) loads on ONNX Runtime
        instead (mtbert/deploy/engine.py), taking `engine`, `batch_size` and `threads`."""
        if is_export(model_dir):
            if options.get("bf16"):
                raise InputError(f"{model_dir} is an export: its graphs run in fp32 or int8; bf16 is for a trained "
                                 "folder (models/<variant>)")
            return load_export(model_dir, **{key: value for key, value in options.items()
                                             if key in ("engine", "batch_size", "threads")})
        model, config = load_model(Path(model_dir))
        return cls(model, config["params"], load_tokenizer(str(tokenizer_dir(model_dir, config))), **options)

    def task(self, name: str) -> Task:
        if name not in self.tasks:
            raise InputError(f"unknown task {name!r}; this model predicts {', '.join(self.tasks)}")
        return self.tasks[name]

    def values(self, task_name: str, texts: Sequence[Text]) -> np.ndarray:
        """Unrounded predictions as the dumps hold them: (N, C) class probabilities, else (N,)."""
        task = self.task(task_name)
        rows = check_texts(task, texts)
        frame = pd.DataFrame(rows, columns=list(task.text_columns))
        for column in task.text_columns:
            frame[column] = clean_text(frame[column], task.name in self.unescape_ptb)
        frame.insert(0, "id", [str(i) for i in range(len(frame))])
        table, _ = encode_rows(self.tokenizer, frame, task, max_length=self.max_length, batch_size=1000)
        return predict_split(self.model, split_of(table, task), self.batch_size, self.device, self.bf16)

    def predict(self, task_name: str, texts: Sequence[Text]) -> list[dict]:
        return self.describe(task_name, self.values(task_name, texts))

    def describe(self, task_name: str, values: np.ndarray) -> list[dict]:
        return describe(self.task(task_name), values)


class EnsemblePredictor(MemberEnsemble):
    """The ensemble stage's choice (metrics/ensemble.json) over trained folders: per task, the average of
    its members' predictions in the stage's own order, so the results are the ensemble's dumps."""

    @classmethod
    def load(cls, ensemble_file: Path | str = "metrics/ensemble.json", models_dir: Path | str = "models",
             **options) -> EnsemblePredictor:
        return cls.from_file(ensemble_file, lambda name: Predictor.load(Path(models_dir) / name, **options))
