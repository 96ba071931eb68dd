"""Export of a trained variant to ONNX (`mtbert export`, stage `export@<variant>`): per task a graph from
token ids to the task's prediction, its int8 version, the tokenizer and a manifest.

A task's graph is its whole path as `predict_split` runs it: its encoder (for CerBERTus the shared layers
and the task's own, from the epoch the task kept), pooling, head and the kind's output (class
probabilities, P(label 1), or the score); for a bi-encoder both sentences through the encoder and their
combination. torch's TorchScript exporter writes it (`torch.onnx.export(dynamo=False)`), with dynamic
batch and sequence axes and the encoder's attention in its eager form, and ONNX Runtime's transformer
optimizer then fuses what it recognises into its own kernels; the encoder family names the fusions that
must be found (mtbert/model/families.py: SkipLayerNormalization and BiasGelu; with transformers 5.24 and
ONNX Runtime 1.32 no Attention pattern is found in either family's graph, docs/inference.md). The
graphs take the family's inputs (no token types for MPNet). ONNX Runtime then runs each graph, through the
engine that deploys it (mtbert/deploy/engine.py), on the first `export.check_rows` dev rows beside
PyTorch; a value that differs by more than `export.tolerance` fails the export, naming the task.

With `export.int8`, ONNX Runtime's dynamic quantization writes int8 graphs (quantize.py). Both engines
predict the whole dev split; their dev metrics go into the export's metrics. A task runs int8 (its entry in
the manifest's `task_engines`, what engine `auto` runs) only where its dev headline drops by no more than
`export.int8_max_drop` and int8 ran the timed dev rows faster than fp32 on this machine; the default engine
(for every task at once) is int8 only where every task is. The manifest (integrity.py) records the tasks,
kinds, text columns, encoding, cleaning, truncation, the engines and each file's sha256.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io as text_io
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from mtbert import io
from mtbert.data.batches import TaskSplit, load_split
from mtbert.data.rawdata import PTB_ESCAPES
from mtbert.data.tasks import Task
from mtbert.deploy.engine import EXPORT_FORMAT, OnnxPredictor, batch_feed, encode, load_tokenizer
from mtbert.evaluation.evaluate import predict_split
from mtbert.evaluation.metrics import overall, task_metrics
from mtbert.export.quantize import quantize
from mtbert.integrity import write_manifest
from mtbert.model.architectures import SHARED_DIR, attention_implementation
from mtbert.model.backbone import load_tokenizer as load_hf_tokenizer
from mtbert.model.saved import TaskSnapshots, epoch_dir, load_model
from mtbert.params import ExportParams
from mtbert.runtime import UserError, release_heap

log = logging.getLogger("export")

TOKENIZER_FILE = "tokenizer.json"
# Two rows of different lengths, so the traced graph pads and masks as real batches do.
EXAMPLE_ROWS = [("A gorgeous, witty film that never slows down.", "A witty film."),
                ("Dull.", "Far too long, and dull, with a plot that goes nowhere.")]
CHECK_BATCH = 8  # rows per batch of the check against PyTorch: several batch widths
TIMING_ROUNDS = 3  # fp32 and int8 alternate, so a change in the machine's speed hits both


class ExportError(UserError, RuntimeError):
    """An exported graph does not reproduce the PyTorch model."""


class TaskGraph(nn.Module):
    """A task of one sentence, or of a pair read as one sequence: token ids to the task's prediction."""

    def __init__(self, model: nn.Module, task: str):
        super().__init__()
        self.model, self.task = model, task

    def forward(self, input_ids, attention_mask, token_type_ids=None):  # none for a family without token types
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
        return self.model.predictions(self.task, self.model(self.task, batch))


class PairGraph(nn.Module):
    """A bi-encoder's task: each sentence through the encoder, then the head's combination, as
    MultitaskModel.forward's bi-encoder branch computes it. That branch runs both sentences as one batch and
    cuts it with len(), which the exporter would freeze at the example's batch size; here each sentence
    runs alone (rows never mix in an encoder, so the values are the same), each padded to its own width."""

    def __init__(self, model: nn.Module, task: str):
        super().__init__()
        self.model, self.task = model, task

    def forward(self, input_ids_1, attention_mask_1, input_ids_2, attention_mask_2):
        model, task = self.model, self.task
        params, head = model.head_params[task], model.heads[task]
        u = model.embed(task, input_ids_1, attention_mask_1, params.pooling)
        v = model.embed(task, input_ids_2, attention_mask_2, params.pooling)
        cosine = params.combine == "cosine"  # the head is the cosine head (MultitaskModel builds it so)
        out = head(u, v) if cosine else head(torch.cat([u, v, (u - v).abs(), u * v], -1))
        return model.predictions(task, model.tasks[task].kind.head_output(out, params, cosine))


@dataclasses.dataclass
class Traced:
    """What the PyTorch side of an export leaves: the manifest of its unfused fp32 graphs, the tasks, their
    dev splits, PyTorch's predictions of each task's first dev rows (the parity check's reference) and
    what the fusions need to know of the encoder."""
    manifest: dict
    tasks: dict[str, Task]
    dev: dict[str, TaskSplit]
    expected: dict[str, np.ndarray]
    encoder: PretrainedConfig
    fusions: tuple[str, ...]


def export_variant(model_dir: Path, out_dir: Path, options: ExportParams, tokenized_dir: Path,
                   threads: int = 0, tasks: list[str] | None = None) -> dict:
    """Write the export of the variant in `model_dir` to `out_dir` (whole or not at all); its report, for
    the metrics file. `tasks`: only these of the model's tasks (an ensemble's member that serves only
    some); None: all. PyTorch's part (the graphs traced, the parity check's reference rows) comes first, and
    the model is dropped before anything else holds memory: the export's peak is then the model's or ONNX
    Runtime's, not their sum (docs/performance.md, the export's memory)."""
    with io.atomic_dir(out_dir) as temp:
        traced = trace(model_dir, temp, options, tokenized_dir, tasks)
        release_heap()
        manifest, dev = traced.manifest, traced.dev
        for entry in manifest["tasks"].values():
            fuse_layers(temp / entry["graphs"]["onnx"], traced.encoder, traced.fusions)
            release_heap()  # the optimizer's copies of this graph, which cycles keep, before the next one's
        write_manifest(temp, manifest)  # the fused graphs' digests
        parity = {name: check_parity(temp, manifest, name, traced.expected[name], dev[name], options, threads)
                  for name in traced.tasks}
        engines = ["onnx", "int8"] if options.int8 else ["onnx"]
        if options.int8:
            write_int8(temp, manifest, options.int8_per_channel)
        predictors = {engine: OnnxPredictor(temp, manifest, engine=engine, batch_size=options.batch_size,
                                            threads=threads) for engine in engines}
        report = measure(predictors, dev, traced.tasks, options,
                         requantize=lambda name: write_int8(temp, manifest, options.int8_per_channel, [name],
                                                            outliers_in_fp32=True))
        report["parity"] = {"tolerance": options.tolerance, "rows": min(options.check_rows, *map(len, dev.values())),
                            "max_abs_difference": parity}
        report["size_mb"] = {engine: graph_megabytes(temp, manifest["tasks"], engine) for engine in engines}
        manifest["default_engine"] = report["engine"]
        choices = task_engines(report, list(traced.tasks), options.int8_max_drop)
        manifest["task_engines"] = {name: engine for name, (engine, _) in choices.items()}
        report["task_engines"] = {name: {"engine": engine, "reason": reason}
                                  for name, (engine, reason) in choices.items()}
        write_manifest(temp, manifest)
    log.info("%s: default engine %s (%s); `auto` runs %s", out_dir, report["engine"], report["reason"],
             ", ".join(f"{name} on {engine}" for name, engine in manifest["task_engines"].items()))
    return report


def trace(model_dir: Path, folder: Path, options: ExportParams, tokenized_dir: Path,
          tasks: list[str] | None = None) -> Traced:
    """The PyTorch side of the export: the model loaded, its unfused graphs of `tasks` (None: all) written to
    `folder`, and its predictions of each one's first `options.check_rows` dev rows. The model is not kept."""
    model, config = load_model(model_dir)
    unknown = [name for name in tasks or () if name not in model.tasks]
    if unknown:
        raise UserError(f"{model_dir}: no task {unknown[0]!r} to export (its tasks: {', '.join(model.tasks)})")
    exported = {name: model.tasks[name] for name in (tasks or model.tasks)}
    dev = {name: load_split(tokenized_dir, task, "dev") for name, task in exported.items()}
    manifest = write_fp32(model, model_dir, config, folder, options.opset, exported)
    expected = {name: predict_split(model, first_rows(dev[name], options.check_rows), CHECK_BATCH,
                                    torch.device("cpu")) for name in exported}
    one = model.for_task(next(iter(model.tasks))) if isinstance(model, TaskSnapshots) else model
    return Traced(manifest=manifest, tasks=exported, dev=dev, expected=expected,
                  encoder=encoder_config(one), fusions=one.family.fusions)


def write_fp32(model: nn.Module, model_dir: Path, config: dict, folder: Path, opset: int,
               tasks: dict[str, Task]) -> dict:
    """The tokenizer and each of `tasks`' unfused fp32 graph; the manifest's contents (fp32 the default
    engine, for now), written once the graphs are fused."""
    params = config["params"]
    write_tokenizer(model_dir, config, folder / TOKENIZER_FILE)
    tokenizer = load_tokenizer(folder / TOKENIZER_FILE, params["tokenize"]["max_length"])
    entries = {}
    for name, task in tasks.items():
        encoding = encoding_of(model, name)
        log.info("%s: exporting the %s graph", name, encoding)
        export_graph(model, name, encoding, tokenizer, folder / f"{name}.onnx", opset)
        entries[name] = task_entry(task, encoding, model.family.graph_inputs(encoding),
                                   name in params["data"]["unescape_ptb"])
    manifest = {"format": EXPORT_FORMAT,
                "source": {"model": str(model_dir), "variant": config.get("variant"),
                           "task_epochs": config.get("task_epochs")},
                "max_length": params["tokenize"]["max_length"], "truncation": "longest_first",
                "tokenizer": TOKENIZER_FILE, "pad_id": model.family.pad_id, "opset": opset,
                "default_engine": "onnx", "tasks": entries}
    return manifest


def write_int8(folder: Path, manifest: dict, per_channel: bool, tasks: list[str] | None = None, *,
               outliers_in_fp32: bool = False) -> None:
    """The int8 graph of each of `tasks` (None: all) beside its fp32 one, and the manifest listing them."""
    for name in tasks or manifest["tasks"]:
        entry = manifest["tasks"][name]
        log.info("%s: quantizing the graph to int8%s", name, " (outlier-prone products in fp32)" * outliers_in_fp32)
        quantize(folder / entry["graphs"]["onnx"], folder / f"{name}.int8.onnx", per_channel=per_channel,
                 outliers_in_fp32=outliers_in_fp32)
        entry["graphs"]["int8"] = f"{name}.int8.onnx"
    write_manifest(folder, manifest)


def encoding_of(model: nn.Module, task: str) -> str:
    """How the task reads its input: `single` (a sentence), `cross` (a pair as one sequence) or `bi`."""
    if model.encoding(task) == "bi":
        return "bi"
    return "cross" if model.tasks[task].is_pair else "single"


def write_tokenizer(model_dir: Path, config: dict, path: Path) -> None:
    """The tokenizer saved with the model's encoder (the one `Predictor.load` uses) as one tokenizer.json,
    without truncation or padding: the engine sets the pipeline's truncation from the manifest."""
    from tokenizers import Tokenizer

    folder = model_dir
    if "task_epochs" in config:
        folder = model_dir / epoch_dir(min(config["task_epochs"].values()))
    backend = Tokenizer.from_str(load_hf_tokenizer(str(folder / SHARED_DIR)).backend_tokenizer.to_str())
    backend.no_truncation()
    backend.no_padding()
    backend.save(str(path))


def task_entry(task: Task, encoding: str, inputs: tuple[str, ...], unescape_ptb: bool) -> dict:
    """A task's manifest entry: what the engine needs to read its texts and describe its predictions."""
    return {"kind": task.kind.name, "columns": task.kind.value_columns(), "text": list(task.text_columns),
            "encoding": encoding, "inputs": list(inputs), "output": "prediction",
            "clean": {"strip": True, "replace": [list(pair) for pair in PTB_ESCAPES.items()] if unescape_ptb else []},
            "graphs": {"onnx": f"{task.name}.onnx"}}


def export_graph(model: nn.Module, task: str, encoding: str, tokenizer, path: Path, opset: int) -> None:
    """The task's ONNX graph, batch and sequence axes dynamic, traced on EXAMPLE_ROWS (fused later)."""
    own = model.for_task(task) if isinstance(model, TaskSnapshots) else model
    graph = (PairGraph if encoding == "bi" else TaskGraph)(own, task).eval()
    family = own.family
    names = family.graph_inputs(encoding)
    tokens = encode(tokenizer, encoding, EXAMPLE_ROWS)
    feed = batch_feed(encoding, tokens, np.arange(len(EXAMPLE_ROWS)), family.pad_id)
    # eager: explicit matmuls, softmax and mask, the form ONNX Runtime's optimizer looks for (its Attention kernel)
    with attention_implementation(own, "eager"), quiet_exporter(), torch.no_grad():
        torch.onnx.export(graph, tuple(torch.from_numpy(feed[name]) for name in names), str(path), dynamo=False,
                          input_names=list(names), output_names=["prediction"], opset_version=opset,
                          dynamic_axes=dynamic_axes(names))


def dynamic_axes(names: tuple[str, ...]) -> dict[str, dict]:
    """Every input's batch axis (one for all) and sequence axis (a bi-encoder's two sentences each their own)."""
    return {name: {0: "batch", 1: "sequence" + (name[-2:] if name[-2:] in ("_1", "_2") else "")} for name in names}


def encoder_config(model: nn.Module):
    return next(module for module in model.modules() if isinstance(module, PreTrainedModel)).config


def fuse_layers(path: Path, config, expected: tuple[str, ...]) -> None:
    """Rewrite the graph at `path` with ONNX Runtime's BERT fusions (the rewrite keeps every value; the
    export's parity check against PyTorch runs on the fused graph); each of the family's `expected` fused
    operators must be found, or a change of library would leave the graph unfused, unnoticed.

    The optimizer copies the graph several times over. So its tensors wait in a file beside it while it
    works, and it reads only those a fusion folds in (biases, LayerNorm scales): its copies are of the graph's
    structure, not of the encoder's weights, and it finds the same fusions. The graph is one file again after."""
    import onnx
    from onnx.external_data_helper import convert_model_to_external_data
    from onnxruntime.transformers.optimizer import optimize_model

    path = path.resolve()
    weights = path.with_name(path.name + ".weights")
    graph = onnx.load(str(path))
    convert_model_to_external_data(graph, all_tensors_to_one_file=True, location=weights.name)
    onnx.save(graph, str(path))
    del graph
    # opt_level 0: the fusions only, without the ONNX Runtime session that would rewrite the graph first
    # (sessions apply their own optimisations at load); the optimizer reads tensors relative to the cwd
    with quiet_exporter(), working_directory(path.parent):
        fused = optimize_model(onnx.load(str(path), load_external_data=False), model_type="bert",
                               num_heads=config.num_attention_heads, hidden_size=config.hidden_size, opt_level=0)
    counts = {name: count for name, count in fused.get_fused_operator_statistics().items() if count}
    log.info("%s: fused %s", path.name, ", ".join(f"{count} {name}" for name, count in counts.items()))
    missing = [name for name in expected if name not in counts]
    if missing:
        raise ExportError(f"{path.name}: ONNX Runtime's optimizer fused no {', '.join(missing)} into the "
                          f"{config.model_type} graph (expected {', '.join(expected)}: mtbert/model/families.py)")
    fused.save_model_to_file(str(path))  # its tensors still in `weights`
    del fused
    onnx.save(onnx.load(str(path)), str(path))  # read back into one file, as the engine and int8 expect it
    weights.unlink()


@contextlib.contextmanager
def working_directory(folder: Path) -> Iterator[None]:
    """The process's working directory set to `folder` for the block (contextlib.chdir, Python 3.11)."""
    before = Path.cwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


@contextlib.contextmanager
def quiet_exporter() -> Iterator[None]:
    """The exporter prints its progress on stdout and warns about its own internals; the log says what is
    being exported, and a failure still raises."""
    printed = text_io.StringIO()
    exporter_log = logging.getLogger("torch.onnx")  # e.g. that torchvision's operators are not registered
    level = exporter_log.level
    exporter_log.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(printed), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        exporter_log.setLevel(level)
        log.debug("exporter: %s", printed.getvalue().strip())


def token_lists(split: TaskSplit, encoding: str, rows: int | None = None) -> dict[str, list[np.ndarray]]:
    """The first `rows` rows (all without) of a tokenized split, as the engine's `encode` gives them."""
    names = ("input_ids_1", "input_ids_2") if encoding == "bi" else ("input_ids", "token_type_ids")
    count = len(split) if rows is None else min(rows, len(split))
    lists = {}
    for name in names:
        column = split.tokens[name]
        lists[name] = [column.values[column.offsets[i]:column.offsets[i + 1]] for i in range(count)]
    return lists


def first_rows(split: TaskSplit, rows: int) -> TaskSplit:
    keep = np.arange(min(rows, len(split)))
    return TaskSplit(task=split.task, ids=split.ids[keep], labels=split.labels[keep],
                     tokens={name: column.take(keep) for name, column in split.tokens.items()}, pad_id=split.pad_id)


def check_parity(folder: Path, manifest: dict, task: str, expected: np.ndarray, dev: TaskSplit,
                 options: ExportParams, threads: int) -> float:
    """The largest difference between the fp32 graph and PyTorch's predictions `expected` of the first dev
    rows; over the tolerance it is an ExportError."""
    engine = OnnxPredictor(folder, manifest, engine="onnx", batch_size=CHECK_BATCH, threads=threads)
    got = engine.values_of_tokens(task, token_lists(dev, manifest["tasks"][task]["encoding"], options.check_rows))
    return parity_difference(task, expected, got, options.tolerance)


def parity_difference(task: str, expected: np.ndarray, got: np.ndarray, tolerance: float) -> float:
    """max |expected - got|; over `tolerance` (or a shape that differs) an ExportError naming the task."""
    if expected.shape != got.shape:
        raise ExportError(f"task {task}: the ONNX graph gives predictions of shape {got.shape}, PyTorch "
                          f"{expected.shape}")
    difference = float(np.max(np.abs(expected - got))) if expected.size else 0.0
    if not difference <= tolerance:  # NaN fails too
        raise ExportError(f"task {task}: the ONNX graph differs from PyTorch by {difference:.3g} on the first "
                          f"{len(expected)} dev rows, over export.tolerance {tolerance:g}; the graph is not written")
    return difference


def measure(predictors: dict[str, OnnxPredictor], dev: dict[str, TaskSplit], tasks: dict[str, Task],
            options: ExportParams, requantize: Callable[[str], None] | None = None) -> dict:
    """Each engine's dev metrics on the whole dev split and its time on the first `speed_rows` rows of
    each task, and the default engine chosen by them. One task at a time, its sessions released after it:
    every session keeps buffers for the largest batch it ran. Where int8 drops a task's dev headline by more
    than export.int8_max_drop, `requantize(task)` writes its int8 graph again with the outlier-prone products
    in fp32 (mtbert/export/quantize.py), and that graph is measured and kept instead."""
    metrics: dict = {engine: {} for engine in predictors}
    seconds = dict.fromkeys(predictors, 0.0)
    requantized: dict[str, float] = {}  # task -> the drop of its first, fully quantized, graph
    for name, task in tasks.items():
        encoding = predictors["onnx"].tasks[name].encoding
        for engine, predictor in predictors.items():
            metrics[engine][name] = dev_metrics(predictor, engine, task, dev[name])
        first_drop = int8_drop(metrics, name, task.headline)
        if requantize is not None and first_drop is not None and first_drop > options.int8_max_drop:
            requantize(name)
            predictors["int8"].release(name)
            metrics["int8"][name] = dev_metrics(predictors["int8"], "int8", task, dev[name])
            requantized[name] = first_drop
        for engine, spent in engine_seconds(predictors, {name: token_lists(dev[name], encoding,
                                                                            options.speed_rows)}).items():
            seconds[engine] += spent
        for predictor in predictors.values():
            predictor.release(name)
    for engine_metrics in metrics.values():
        engine_metrics["overall"] = overall(engine_metrics, tasks)
    report: dict = {"dev": metrics, "speed": {"rows_per_task": min(options.speed_rows, *map(len, dev.values())),
                                              "rounds": TIMING_ROUNDS, "threads": predictors["onnx"].threads,
                                              "seconds": seconds}}
    if "int8" in metrics:
        report["int8_drop"] = {name: int8_drop(metrics, name, task.headline) for name, task in tasks.items()}
        report["int8_outliers_in_fp32"] = {name: {"drop_fully_quantized": drop}
                                           for name, drop in requantized.items()}
        # rounded as the metrics file records it, so that the reasons read from the file give the same words
        report["speed"]["int8_speedup"] = io.rounded(seconds["onnx"] / seconds["int8"])
    report["engine"], report["reason"] = choose_engine(report.get("int8_drop"), seconds, options.int8_max_drop,
                                                       {name: task.headline for name, task in tasks.items()})
    return report


def dev_metrics(predictor: OnnxPredictor, engine: str, task: Task, split: TaskSplit) -> dict:
    log.info("%s: dev metrics of the %s graph", task.name, engine)
    values = predictor.values_of_tokens(task.name, token_lists(split, predictor.tasks[task.name].encoding))
    return task_metrics(task, values, split.labels)


def int8_drop(metrics: dict, task: str, headline: str) -> float | None:
    """How much lower the int8 graph's dev headline is than fp32's (None without int8)."""
    if "int8" not in metrics:
        return None
    return metrics["onnx"][task][headline] - metrics["int8"][task][headline]


def engine_seconds(predictors: dict[str, OnnxPredictor], tokens: dict[str, dict]) -> dict[str, float]:
    """Seconds each engine takes over `tokens` (every task), summed over TIMING_ROUNDS alternating rounds
    after one untimed round (sessions loaded, buffers allocated)."""
    seconds = dict.fromkeys(predictors, 0.0)
    for round_ in range(TIMING_ROUNDS + 1):
        for engine, predictor in predictors.items():
            started = time.perf_counter()
            for task, rows in tokens.items():
                predictor.values_of_tokens(task, rows)
            if round_:
                seconds[engine] += time.perf_counter() - started
    return seconds


def choose_engine(int8_drop: dict[str, float] | None, seconds: dict[str, float], max_drop: float,
                  headlines: dict[str, str]) -> tuple[str, str]:
    """The default engine and why: int8 where no task's dev headline drops by more than max_drop and it
    was faster here; else fp32 (`onnx`)."""
    if int8_drop is None:
        return "onnx", "export.int8 is false: no int8 graphs"
    worst = max(int8_drop, key=lambda name: int8_drop[name])
    drop = int8_drop[worst]
    if drop > max_drop:
        return "onnx", (f"int8 drops {worst}'s dev {headlines[worst]} by {drop:.4f}, more than "
                        f"export.int8_max_drop {max_drop:g}")
    if seconds["int8"] >= seconds["onnx"]:
        return "onnx", (f"int8 was not faster on this machine: {seconds['int8']:.3f} s against fp32's "
                        f"{seconds['onnx']:.3f} s on the timed dev rows")
    return "int8", (f"int8 keeps every task's dev headline within {max_drop:g} of fp32 (largest drop: {worst} "
                    f"{drop:.4f}) and ran the timed dev rows {seconds['onnx'] / seconds['int8']:.2f}x as fast")


def task_engines(report: dict, tasks: list[str], max_drop: float) -> dict[str, tuple[str, str]]:
    """Per task: int8 or fp32 (`onnx`), and why; what `auto` runs. int8 where it kept the task's dev
    headline within `max_drop` of fp32's and the export's int8 graphs ran faster here. So one task that
    int8 costs too much keeps fp32 without holding the others back (the default engine is int8 only where
    every task chose it)."""
    choices = {}
    speedup = report.get("speed", {}).get("int8_speedup", 0.0)
    for task in tasks:
        drop = report.get("int8_drop", {}).get(task)
        if drop is None:
            choices[task] = ("onnx", "export.int8 is false: no int8 graph")
        elif drop > max_drop:
            choices[task] = ("onnx", f"int8 drops the dev headline by {drop:.4f}, more than export.int8_max_drop "
                                     f"{max_drop:g}")
        elif speedup <= 1.0:
            choices[task] = ("onnx", f"int8 was not faster on this machine ({speedup:.2f}x)")
        else:
            choices[task] = ("int8", f"int8 drops the dev headline by {drop:.4f} (at most {max_drop:g}) and ran "
                                     f"{speedup:.2f}x as fast")
    return choices


def graph_megabytes(folder: Path, entries: dict, engine: str) -> float:
    return sum((folder / entry["graphs"][engine]).stat().st_size for entry in entries.values()) / 2 ** 20
