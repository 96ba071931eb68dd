"""The ONNX Runtime engine: an exported variant (`mtbert export`) on new text, with only `tokenizers`,
`onnxruntime` and `numpy` loaded (no torch, no transformers), so a command starts in a fraction of a second.

    predictor = OnnxPredictor.load("exports/base")            # engine: the export's default (onnx or int8)
    predictor.predict("sst", ["A gorgeous, witty film."])       # [{'prob_0': ..., 'prob_4': ..., 'label': 4}]
    OnnxEnsemblePredictor.load("metrics/ensemble.json", "exports").predict("sts", [("A man sings.", "A man sings.")])

An export folder holds per task an ONNX graph from token ids to the task's prediction (`<task>.onnx`, and
with int8 `<task>.int8.onnx`), the tokenizer (`tokenizer.json`) and `manifest.json`: the tasks, their
kinds, text columns, encoding and cleaning, the truncation, the default engine and each file's sha256
(checked before a file is used). Texts go through the steps of the PyTorch engine (mtbert/inference.py):
the same checks and cleaning, the same tokenizer and truncation, length-sorted batches each padded to its
own longest row; the results have the same keys, and equal its values within the tolerance the export
checked (`export.tolerance`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mtbert.deploy.members import MemberEnsemble, average
from mtbert.inputs import InputError, Text, check_texts, clean
from mtbert.integrity import MANIFEST_FILE, read_manifest, verify
from mtbert.runtime import UserError

EXPORT_FORMAT = 1  # the layout of an export folder and its manifest
ENGINES = ("onnx", "int8")  # the graphs of an export: fp32 as exported, int8 weights
ENCODINGS = ("single", "cross", "bi")  # one sentence; a pair as one sequence; a pair, each sentence alone
KINDS = ("classification", "binary", "regression")


class ExportFolderError(UserError, ValueError):
    """An export folder is missing, of another format, or lacks the graphs asked for."""


@dataclasses.dataclass(frozen=True)
class ExportedTask:
    """One task of an export, as its manifest describes it."""
    name: str
    kind: str  # classification | binary | regression (mtbert/data/kinds.py)
    columns: tuple[str, ...]  # the value columns of a result (the dump's), e.g. prob_0..prob_4
    text_columns: tuple[str, ...]
    encoding: str  # single | cross | bi
    replacements: tuple[tuple[str, str], ...]  # the cleaning after the strip, in order
    graphs: dict[str, str]  # engine -> file

    @classmethod
    def from_manifest(cls, name: str, entry, where: str) -> ExportedTask:
        try:
            task = cls(name=name, kind=entry["kind"], columns=tuple(entry["columns"]),
                       text_columns=tuple(entry["text"]), encoding=entry["encoding"],
                       replacements=tuple((a, b) for a, b in entry["clean"]["replace"]),
                       graphs=dict(entry["graphs"]))
        except (KeyError, TypeError, ValueError):
            raise ExportFolderError(f"{where}: tasks.{name} lacks kind, columns, text, encoding, clean or graphs, "
                                    "as `mtbert export` writes them") from None
        if task.kind not in KINDS or task.encoding not in ENCODINGS or not set(task.graphs) <= set(ENGINES):
            raise ExportFolderError(f"{where}: tasks.{name}: unknown kind {task.kind!r}, encoding {task.encoding!r} "
                                    f"or engine in {sorted(task.graphs)}")
        return task

    def labels(self, values: np.ndarray) -> np.ndarray:
        """The predicted labels, as the task's kind gives them (kinds.py's predicted_labels)."""
        if self.kind == "classification":
            return values.argmax(-1)
        if self.kind == "binary":
            return (values >= 0.5).astype(np.int64)
        return values

    def describe(self, values: np.ndarray) -> list[dict]:
        """One JSON-ready dict per row, as inference.describe makes it: the value columns and the label."""
        matrix = values.reshape(len(values), -1)
        return [{**{name: float(value) for name, value in zip(self.columns, row, strict=True)}, "label": label.item()}
                for row, label in zip(matrix, np.asarray(self.labels(values)), strict=True)]


def is_export(folder: Path | str) -> bool:
    """Whether `folder` is an export (it has the manifest `mtbert export` writes)."""
    return (Path(folder) / MANIFEST_FILE).is_file()


class OnnxPredictor:
    """An exported variant, ready to predict any of its tasks on lists of texts with ONNX Runtime."""

    def __init__(self, folder: Path, manifest: dict, *, engine: str = "auto", batch_size: int = 128,
                 threads: int = 0):
        self.folder, self.batch_size, self.threads = folder, batch_size, threads
        where = str(folder / MANIFEST_FILE)
        tasks = manifest.get("tasks")
        if not isinstance(tasks, dict) or not tasks:
            raise ExportFolderError(f"{where}: no tasks; expected a manifest written by `mtbert export`")
        self.tasks = {name: ExportedTask.from_manifest(name, entry, where) for name, entry in tasks.items()}
        self.engine = resolve_engine(engine, manifest, self.tasks, where)
        # `auto` in an ensemble's member: int8 for the tasks where the export found it good enough
        self.task_engines = manifest.get("task_engines", {}) if engine == "auto" else {}
        self.tokenizer = load_tokenizer(folder / manifest["tokenizer"], manifest["max_length"])
        # two members with the same key tokenize alike: an ensemble encodes a text once for both
        self.tokenizer_key = (manifest.get("files", {}).get(manifest["tokenizer"]), manifest["max_length"])
        self.pad_id = manifest.get("pad_id", 0)  # an export from before it was recorded is BERT's: 0
        if not isinstance(self.pad_id, int) or isinstance(self.pad_id, bool):
            raise ExportFolderError(f"{where}: pad_id is {self.pad_id!r}, expected the encoder's pad id (an integer), "
                                    "as `mtbert export` writes it")
        self.sessions: dict[str, object] = {}

    @classmethod
    def load(cls, folder: Path | str, **options) -> OnnxPredictor:
        """From an export folder; its tokenizer is checked against the manifest now, each graph when first used."""
        folder = Path(folder)
        if not folder.is_dir():
            raise ExportFolderError(f"{folder} is missing; expected an export folder (`mtbert export` or "
                                    "`dvc repro export@<variant>` writes exports/<variant>)")
        manifest = verify(folder, [])
        if manifest.get("format") != EXPORT_FORMAT:
            raise ExportFolderError(f"{folder / MANIFEST_FILE}: an export of format {manifest.get('format')!r}; "
                                    f"this mtbert reads format {EXPORT_FORMAT} (export the model again)")
        for key in ("tokenizer", "max_length", "default_engine"):
            if key not in manifest:
                raise ExportFolderError(f"{folder / MANIFEST_FILE}: no {key!r}; expected a manifest written by "
                                        "`mtbert export`")
        verify(folder, [manifest["tokenizer"]])
        return cls(folder, manifest, **options)

    def task(self, name: str) -> ExportedTask:
        if name not in self.tasks:
            raise InputError(f"unknown task {name!r}; this model predicts {', '.join(self.tasks)}")
        return self.tasks[name]

    def values(self, task_name: str, texts: Sequence[Text]) -> np.ndarray:
        """Unrounded predictions as the dumps hold them: (N, C) class probabilities, else (N,)."""
        task = self.task(task_name)
        rows = [tuple(clean(text, task.replacements) for text in row) for row in check_texts(task, texts)]
        return self.values_of_tokens(task_name, encode(self.tokenizer, task.encoding, rows))

    def predict(self, task_name: str, texts: Sequence[Text]) -> list[dict]:
        return self.describe(task_name, self.values(task_name, texts))

    def describe(self, task_name: str, values: np.ndarray) -> list[dict]:
        return self.task(task_name).describe(values)

    def values_of_tokens(self, task_name: str, tokens: dict[str, list[Sequence[int]]]) -> np.ndarray:
        """Predictions of tokenized rows (as `encode` makes them) in their order: length-sorted batches, each
        padded to its longest row, as the PyTorch engine's `predict_split` runs them."""
        task = self.tasks[task_name]
        session = self.session(task_name)
        names = [entry.name for entry in session.get_inputs()]
        if task.encoding == "bi":
            lengths = np.maximum(row_lengths(tokens["input_ids_1"]), row_lengths(tokens["input_ids_2"]))
        else:
            lengths = row_lengths(tokens["input_ids"])
        order = np.argsort(lengths, kind="stable")
        result = np.empty(0, dtype=np.float64)  # replaced by the first batch's shape
        for start in range(0, len(order), self.batch_size):
            rows = order[start:start + self.batch_size]
            feed = batch_feed(task.encoding, tokens, rows, self.pad_id)
            output = session.run(None, {name: feed[name] for name in names})[0]
            if start == 0:
                result = np.empty((len(order), *output.shape[1:]), dtype=np.float64)
            result[rows] = output
        return result

    def session(self, task_name: str):
        """The task's ONNX Runtime session for this predictor's engine, loaded (and its file checked) once."""
        if task_name not in self.sessions:
            graph = self.tasks[task_name].graphs[self.task_engines.get(task_name, self.engine)]
            verify(self.folder, [graph])
            self.sessions[task_name] = open_session(self.folder / graph, self.threads)
        return self.sessions[task_name]

    def release(self, task_name: str) -> None:
        """Drop the task's session, and with it the buffers ONNX Runtime keeps for it: a session's arena
        stays as large as the largest batch it ran, so sessions of many tasks and engines add up."""
        self.sessions.pop(task_name, None)

    def warm(self) -> None:
        """Load every task's session now (a server does, so no request waits for one)."""
        for name in self.tasks:
            self.session(name)


class ExportedEnsemble(MemberEnsemble):
    """An ensemble's export (`exports/ensemble`, mtbert/export/ensemble.py): its members' exports in
    one folder, used as one model. Per task, the members' predictions are averaged in the ensemble stage's
    order. A text is checked and cleaned once, and tokenized once for each tokenizer and encoding its
    members read (a bi-encoder reads each sentence, a cross-encoder the pair), not once per member: members
    of one encoder share their tokens, and members of different encoders (BERT and MPNet) each get their own."""

    @classmethod
    def load(cls, folder: Path | str, **options) -> ExportedEnsemble:
        folder = Path(folder)
        manifest = verify(folder, [])
        if manifest.get("format") != EXPORT_FORMAT:
            raise ExportFolderError(f"{folder / MANIFEST_FILE}: an export of format {manifest.get('format')!r}; "
                                    f"this mtbert reads format {EXPORT_FORMAT} (export the ensemble again)")
        members = manifest.get("members")
        if not isinstance(members, dict) or not members:
            raise ExportFolderError(f"{folder / MANIFEST_FILE}: no `members`; expected the manifest of an "
                                    "ensemble's export (`dvc repro export_ensemble`)")
        needed = sorted({name for order in members.values() for name in order})
        return cls(members, {name: OnnxPredictor.load(folder / name, **options) for name in needed})

    def values(self, task_name: str, texts: Sequence[Text]) -> np.ndarray:
        members = list(dict.fromkeys(self.order(task_name)))
        task = self.predictors[members[0]].task(task_name)  # the task's checks and cleaning are every member's
        rows = [tuple(clean(text, task.replacements) for text in row) for row in check_texts(task, texts)]
        reads = {name: self.reads(name, task_name) for name in members}
        encoded: dict[tuple, dict] = {}  # each tokenizer and encoding once, however many members share it
        for name, read in reads.items():
            if read not in encoded:
                encoded[read] = encode(self.predictors[name].tokenizer, read[1], rows)
        return self.values_of_tokens(task_name, {name: encoded[read] for name, read in reads.items()})

    def reads(self, name: str, task_name: str) -> tuple:
        """What a member reads of a task's text: its tokenizer and its encoding."""
        predictor = self.predictors[name]
        return predictor.tokenizer_key, predictor.tasks[task_name].encoding

    def values_of_tokens(self, task_name: str, tokens: dict[str, dict]) -> np.ndarray:
        """The average over the task's members of their predictions of tokenized rows, given per member."""
        order = self.order(task_name)
        predictions = {name: self.predictors[name].values_of_tokens(task_name, tokens[name])
                       for name in dict.fromkeys(order)}
        return average(predictions, order)

    def order(self, task_name: str) -> list[str]:
        if task_name not in self.members:
            raise InputError(f"unknown task {task_name!r}; this ensemble predicts {', '.join(self.members)}")
        return self.members[task_name]

    def release(self, task_name: str) -> None:
        for predictor in self.predictors.values():
            predictor.release(task_name)

    def warm(self) -> None:
        for predictor in self.predictors.values():
            predictor.warm()


def load_export(folder: Path | str, **options) -> OnnxPredictor | ExportedEnsemble:
    """An export folder as one predictor: a variant's export, or an ensemble's."""
    if (Path(folder) / MANIFEST_FILE).is_file() and "members" in read_manifest(folder):
        return ExportedEnsemble.load(folder, **options)
    return OnnxPredictor.load(folder, **options)


class OnnxEnsemblePredictor(MemberEnsemble):
    """The ensemble stage's choice (metrics/ensemble.json) over exported members: per task, the average of
    their predictions in the stage's own order, so the results are the ensemble's dumps (within the
    export's tolerance)."""

    @classmethod
    def load(cls, ensemble_file: Path | str = "metrics/ensemble.json", models_dir: Path | str = "exports",
             **options) -> OnnxEnsemblePredictor:
        return cls.from_file(ensemble_file, lambda name: OnnxPredictor.load(Path(models_dir) / name, **options))

    def warm(self) -> None:
        for predictor in self.predictors.values():
            predictor.warm()


def resolve_engine(engine: str, manifest: dict, tasks: dict[str, ExportedTask], where: str) -> str:
    """`auto`: the export's default engine; else the one asked for, which every task must have."""
    choice = manifest["default_engine"] if engine == "auto" else engine
    if choice not in ENGINES:
        raise ExportFolderError(f"{where}: engine {choice!r}; expected one of {', '.join(ENGINES)}")
    lacking = [name for name, task in tasks.items() if choice not in task.graphs]
    if lacking:
        hint = " (exported with export.int8: false)" if choice == "int8" else ""
        raise ExportFolderError(f"{where}: task {lacking[0]} has no {choice} graph{hint}; "
                                f"the export has: {', '.join(sorted(tasks[lacking[0]].graphs))}")
    return choice


def load_tokenizer(path: Path, max_length: int):
    """The export's tokenizer with the pipeline's truncation: max_length tokens, longest-first for pairs,
    no padding (each batch is padded to its own longest row)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.enable_truncation(max_length=int(max_length), stride=0, strategy="longest_first", direction="right")
    tokenizer.no_padding()
    return tokenizer


def open_session(path: Path, threads: int = 0):
    """An ONNX Runtime CPU session: `threads` intra-op threads (0: ONNX Runtime's default, one per core)."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3  # errors only: its warnings are about graph rewrites, not about results
    # Each session has its own threads, which by default spin for a while after a call; with several sessions
    # (tasks, engines, ensemble members) taking turns they hold the cores the next call needs.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads:
        options.intra_op_num_threads = threads
    try:
        return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as error:  # onnxruntime raises its own exception types, one per failure
        message = " ".join(str(error).split())[:300]
        raise ExportFolderError(f"{path}: ONNX Runtime cannot load it ({message}); export the model again "
                                "with this mtbert") from None


def encode(tokenizer, encoding: str, rows: Sequence[tuple[str, ...]]) -> dict[str, list[Sequence[int]]]:
    """Token ids per model input as the `tokenize` stage writes them: a sentence, or a pair as one sequence,
    with token types; or (bi) each sentence of a pair alone."""
    if encoding == "bi":
        sides = [tokenizer.encode_batch([row[side] for row in rows]) for side in (0, 1)]
        return {"input_ids_1": [e.ids for e in sides[0]], "input_ids_2": [e.ids for e in sides[1]]}
    encodings = tokenizer.encode_batch([row[0] for row in rows] if encoding == "single" else list(rows))
    return {"input_ids": [e.ids for e in encodings], "token_type_ids": [e.type_ids for e in encodings]}


def row_lengths(rows: list[Sequence[int]]) -> np.ndarray:
    return np.fromiter((len(row) for row in rows), dtype=np.int64, count=len(rows))


def padded(rows: list[Sequence[int]], width: int, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(ids, attention mask), each (len(rows), width), padded with `pad_id` as the PyTorch engine pads."""
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for index, row in enumerate(rows):
        ids[index, :len(row)] = row
        mask[index, :len(row)] = 1
    return ids, mask


def batch_feed(encoding: str, tokens: dict[str, list[Sequence[int]]], rows: np.ndarray,
               pad_id: int = 0) -> dict[str, np.ndarray]:
    """A batch's graph inputs, each padded to its longest row (a bi-encoder's two sentences each to their own)
    with the encoder's pad id; token types for every encoder (a graph of a family without them ignores them)."""
    feed = {}
    if encoding == "bi":
        for side in ("1", "2"):
            ids = [tokens[f"input_ids_{side}"][row] for row in rows]
            feed[f"input_ids_{side}"], feed[f"attention_mask_{side}"] = padded(ids, max(map(len, ids)), pad_id)
        return feed
    ids = [tokens["input_ids"][row] for row in rows]
    width = max(map(len, ids))
    feed["input_ids"], feed["attention_mask"] = padded(ids, width, pad_id)
    feed["token_type_ids"], _ = padded([tokens["token_type_ids"][row] for row in rows], width)
    return feed
