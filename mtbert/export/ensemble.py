"""The ensemble as one deployable model (stage `export_ensemble`): exports/ensemble/.

The ensemble stage chose, per task, which members to average (metrics/ensemble.json). This writes each
member's export (mtbert/export/variant.py: its graphs for the tasks the ensemble uses it for, int8 beside
fp32, its tokenizer) into one folder, with a manifest naming each task's members in the stage's order and
a model card. `mtbert predict --model exports/ensemble`, `mtbert serve --model exports/ensemble` and
`Predictor.load("exports/ensemble")` load it as one model (mtbert/deploy/engine.py `ExportedEnsemble`).
Members may have different encoders: each is checked on its own variant's tokenized data
(`<tokenized_root>/<member>`), and the export tokenizes a text once per tokenizer.

int8 stays a choice per member and per task: a member's task runs its int8 graph only where int8 kept that
task's dev headline within `export.int8_max_drop` of fp32 and ran faster on this machine. The members'
drops can add up, so the ensemble as deployed is then held to the same bound per task: where a task's
ensemble drops more than `export.int8_max_drop` below the all-fp32 ensemble, its members' int8 graphs are
written again with the outlier-prone products in fp32 (as a member's own export does for a task over the
bound) and the ensemble measured again; if it is still over, the task runs fp32 in every member. The report
(metrics/export/ensemble.json) holds the check of the fp32 graphs on the first `export.check_rows` dev
rows against the members' PyTorch predictions in fp32, averaged as the ensemble averages them (over
`export.tolerance` the export fails, naming the task); the largest difference from the ensemble stage's
dumps on every dev row (bf16 where `predict` ran in bf16, so not held to the tolerance); the dev metrics
of the fp32 graphs and of the chosen ones; each member's choice and why; and the latency of one sentence
and one pair, and the throughput, of the ensemble and of its first member alone.
"""

from __future__ import annotations

import gc
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from mtbert import io
from mtbert.data.batches import TaskSplit, load_split
from mtbert.data.tasks import Task, tokenized_path
from mtbert.deploy.engine import EXPORT_FORMAT, ExportedEnsemble
from mtbert.deploy.members import read_members
from mtbert.evaluation.metrics import overall, task_metrics
from mtbert.evaluation.predictions import read_aligned
from mtbert.export.variant import export_variant, parity_difference, task_engines, token_lists, write_int8
from mtbert.integrity import DIGEST, read_manifest, write_manifest
from mtbert.params import ExportParams

log = logging.getLogger("export")

LATENCY_CALLS = 30  # one-text calls timed per task, after one untimed


def export_ensemble(ensemble_file: Path, models_dir: Path, dumps_dir: Path, out_dir: Path, tasks: dict[str, Task],
                    options: ExportParams, tokenized_root: Path, threads: int = 0) -> dict:
    """Write the ensemble's export to `out_dir` (whole or not at all); its report, for the metrics file.
    Each member's tokenized data is `tokenized_root / <member>`."""
    members = read_members(ensemble_file)
    needed = sorted({name for order in members.values() for name in order})
    # what each member serves: a greedy ensemble may use a member for some tasks, whose graphs alone it exports
    serves = {name: [task for task, order in members.items() if name in order] for name in needed}
    with io.atomic_dir(out_dir) as temp:
        reports = {}
        for name in needed:
            reports[name] = export_variant(models_dir / name, temp / name, options, tokenized_root / name, threads,
                                           tasks=serves[name])
            gc.collect()  # the member's model and sessions, before the next one's
        choices = {name: task_engines(reports[name], serves[name], options.int8_max_drop) for name in needed}
        write_choices(temp, members, choices, ensemble_file, models_dir)
        report = measure_ensemble(temp, {name: tasks[name] for name in members}, models_dir, dumps_dir,
                                  tokenized_root, options, threads)
        if report["int8_too_costly"]:  # the members' int8 drops added up
            def write(engines: dict) -> None:
                write_choices(temp, members, engines, ensemble_file, models_dir)

            choices = settle_int8(temp, choices, reports, report, tasks, tokenized_root, options, threads, write)
            write(choices)
        report["speed"] = ensemble_speed(temp, tokenized_root / needed[0], {name: tasks[name] for name in members},
                                         options, threads)
        report["members"] = {name: {task: {"engine": engine, "reason": reason}
                                    for task, (engine, reason) in choices[name].items()} for name in needed}
        report["order"] = members
    log.info("%s: %d members; dev overall fp32 %.4f, as deployed %.4f", out_dir, len(needed),
             report["dev"]["onnx"]["overall"], report["dev"]["deployed"]["overall"])
    return report


def settle_int8(folder: Path, choices: dict, reports: dict, report: dict, tasks: dict[str, Task],
                tokenized_root: Path, options: ExportParams, threads: int, write: Callable[[dict], None]) -> dict:
    """The members' engines where int8 in every member dropped a task's ensemble past export.int8_max_drop: a
    second try, as a member's own export makes it (its int8 graphs written again with the outlier-prone
    products in fp32, then the ensemble measured again), and fp32 in every member where it is still too costly.
    `write(choices)` writes the members' engines; `report`'s deployed dev metrics, `int8_too_costly` and
    `int8_outliers_in_fp32` follow."""
    costly = report["int8_too_costly"]
    retried = requantize_members(folder, choices, reports, list(costly), options)
    write(choices)
    again = deployed_dev(folder, {name: tasks[name] for name in retried}, tokenized_root, options, threads)
    for name in retried:
        drop = report["dev"]["onnx"][name][tasks[name].headline] - again[name][tasks[name].headline]
        report["int8_outliers_in_fp32"][name] = {"drop_fully_quantized": costly[name], "drop": round(drop, 6)}
        if drop <= options.int8_max_drop:
            del costly[name]
            report["dev"]["deployed"][name] = again[name]
        else:
            costly[name] = drop
    for name in costly:
        report["dev"]["deployed"][name] = report["dev"]["onnx"][name]
    report["dev"]["deployed"]["overall"] = overall(report["dev"]["deployed"], tasks)
    return fp32_for(choices, costly)


def requantize_members(folder: Path, choices: dict, reports: dict, tasks: list[str],
                       options: ExportParams) -> list[str]:
    """For each of `tasks`, every member's int8 graph that it runs written again with the outlier-prone products
    in fp32 (mtbert/export/quantize.py), unless the member's own export already did; the tasks with a graph
    written again."""
    retried = []
    for task in tasks:
        for name, engines in choices.items():
            if engines.get(task, ("onnx",))[0] != "int8" or task in reports[name].get("int8_outliers_in_fp32", {}):
                continue
            write_int8(folder / name, manifest_contents(folder / name), options.int8_per_channel, [task],
                       outliers_in_fp32=True)
            engines[task] = ("int8", f"{engines[task][1]}; quantized again with its outlier-prone products in fp32, "
                                     "as the ensemble's int8 drop over every member was over the bound")
            retried.append(task)
    return list(dict.fromkeys(retried))


def deployed_dev(folder: Path, tasks: dict[str, Task], tokenized_root: Path, options: ExportParams,
                 threads: int) -> dict[str, dict]:
    """The dev metrics of the graphs the ensemble deploys (`auto`), for `tasks`."""
    members = read_manifest(folder)["members"]
    ensemble = ExportedEnsemble.load(folder, engine="auto", batch_size=options.batch_size, threads=threads)
    metrics = {}
    for name, task in tasks.items():
        dev = {member: load_split(tokenized_root / member, task, "dev") for member in members[name]}
        values = ensemble.values_of_tokens(name, split_tokens(ensemble, name, dev))
        metrics[name] = task_metrics(task, values, dev[members[name][0]].labels)
        ensemble.release(name)
    return metrics


def fp32_for(choices: dict, drops: dict[str, float]) -> dict:
    """Every member's engine for the tasks in `drops` set to fp32, with the reason."""
    return {name: {task: (("onnx", f"int8 in every member dropped the ensemble's dev headline by {drops[task]:.4f}, "
                                   "more than export.int8_max_drop") if task in drops else choice)
                   for task, choice in tasks.items()} for name, tasks in choices.items()}


def write_choices(folder: Path, members: dict[str, list[str]], choices: dict, ensemble_file: Path,
                  models_dir: Path) -> None:
    """Each member's engines in its manifest, the card, and the ensemble's manifest over them all."""
    for name, tasks in choices.items():
        keep_tasks(folder / name, {task: engine for task, (engine, _) in tasks.items()})
    write_card(folder, members, choices)
    write_manifest(folder, {"format": EXPORT_FORMAT, "members": members,
                            "source": {"ensemble": str(ensemble_file), "models": str(models_dir)}})


def keep_tasks(folder: Path, engines: dict[str, str]) -> None:
    """A member's export cut to the tasks it serves in the ensemble, with the engine chosen for each."""
    manifest = manifest_contents(folder)
    for name, entry in manifest["tasks"].items():
        if name not in engines:
            for graph in entry["graphs"].values():
                (folder / graph).unlink(missing_ok=True)
    manifest["tasks"] = {name: entry for name, entry in manifest["tasks"].items() if name in engines}
    manifest["task_engines"] = engines
    write_manifest(folder, manifest)


def manifest_contents(folder: Path) -> dict:
    """A folder's manifest without what writing it computes (each file's sha256, its own digest)."""
    return {key: value for key, value in read_manifest(folder).items() if key not in ("files", DIGEST)}


def write_card(folder: Path, members: dict[str, list[str]], choices: dict) -> None:
    lines = ["# The ensemble, exported", "",
             "Per task, the average of its members' predictions, in the order the `ensemble` stage chose "
             "(metrics/ensemble.json). Load it as one model:", "",
             "```bash", "mtbert predict --model exports/ensemble --task sst \"A gorgeous, witty film.\"",
             "mtbert serve --model exports/ensemble", "```", "",
             "| task | members (engine) |", "|---|---|"]
    for task, order in members.items():
        used = ", ".join(f"{name} ({choices[name][task][0]})" for name in order)
        lines.append(f"| {task} | {used} |")
    lines += ["", "Each member's folder is its own export (graphs, tokenizer, manifest). The check against the "
              "ensemble's dumps, the dev metrics and the latency are in metrics/export/ensemble.json.", ""]
    (folder / "README.md").write_text("\n".join(lines), encoding="utf-8")


def measure_ensemble(folder: Path, tasks: dict[str, Task], models_dir: Path, dumps_dir: Path, tokenized_root: Path,
                     options: ExportParams, threads: int) -> dict:
    """The check against PyTorch, the difference from the ensemble's dumps, the dev metrics of the fp32 and
    the deployed graphs, and the tasks whose int8 graphs, together, cost more than export.int8_max_drop."""
    members = read_manifest(folder)["members"]
    # each member's dev splits, tokenized by its own encoder; the ids and labels are every member's
    dev = {member: {name: load_split(tokenized_root / member, task, "dev") for name, task in tasks.items()
                    if member in members[name]} for member in {m for order in members.values() for m in order}}
    # PyTorch first, its models gone before ONNX Runtime's sessions load: together they set the peak
    reference = pytorch_average(members, models_dir, dev, options.check_rows)
    predictors = {engine: ExportedEnsemble.load(folder, engine=engine, batch_size=options.batch_size, threads=threads)
                  for engine in ("onnx", "auto")}
    metrics: dict = {"onnx": {}, "deployed": {}}
    parity, from_dumps = {}, {}
    for name, task in tasks.items():
        tokens = split_tokens(predictors["onnx"], name, {member: dev[member][name] for member in members[name]})
        fp32 = predictors["onnx"].values_of_tokens(name, tokens)
        rows = len(reference[name])
        parity[name] = parity_difference(name, reference[name], fp32[:rows], options.tolerance)
        labelled = dev[members[name][0]][name]
        dumps = read_aligned(dumps_dir, task, "dev", labelled.ids)
        from_dumps[name] = round(float(np.max(np.abs(dumps - fp32))), 6)
        metrics["onnx"][name] = task_metrics(task, fp32, labelled.labels)
        deployed = predictors["auto"].values_of_tokens(name, tokens)
        metrics["deployed"][name] = task_metrics(task, deployed, labelled.labels)
        for predictor in predictors.values():  # a session keeps buffers for the largest batch it ran
            predictor.release(name)
    for engine_metrics in metrics.values():
        engine_metrics["overall"] = overall(engine_metrics, tasks)
    drops = {name: metrics["onnx"][name][task.headline] - metrics["deployed"][name][task.headline]
             for name, task in tasks.items()}
    return {"dev": metrics,
            "parity": {"tolerance": options.tolerance, "rows": options.check_rows, "max_abs_difference": parity,
                       "against": "the members' PyTorch predictions in fp32, averaged"},
            "from_ensemble_dumps": {"max_abs_difference": from_dumps, "rows": "every dev row",
                                    "dumps": str(dumps_dir)},
            "int8_drop": {name: round(drop, 6) for name, drop in drops.items()},  # the ensemble's, as first chosen
            "int8_too_costly": {name: drop for name, drop in drops.items() if drop > options.int8_max_drop},
            "int8_outliers_in_fp32": {}}  # the tasks of a second try (settle_int8)


def ensemble_speed(folder: Path, tokenized_dir: Path, tasks: dict[str, Task], options: ExportParams,
                   threads: int) -> dict:
    """The latency and throughput of the ensemble as deployed, and of its first member alone."""
    ensemble = ExportedEnsemble.load(folder, batch_size=options.batch_size, threads=threads)
    texts = dev_texts(tokenized_dir, tasks, options.speed_rows)
    first = next(name for name, predictor in ensemble.predictors.items() if predictor is ensemble.first)
    return {"threads": threads, "ensemble": latency(ensemble, texts),
            "first_member": {"name": first, **latency(ensemble.first, texts)}}


def pytorch_average(members: dict[str, list[str]], models_dir: Path, dev: dict[str, dict[str, TaskSplit]],
                    rows: int) -> dict[str, np.ndarray]:
    """Per task, the average in the ensemble's order of its members' fp32 PyTorch predictions of the first
    `rows` dev rows: what the fp32 graphs must give. The ensemble stage's dumps cannot be that reference:
    `predict` wrote them in bf16 where `predict.bf16` chose it, a difference of about 1e-2."""
    import torch

    from mtbert.deploy.members import average
    from mtbert.evaluation.evaluate import predict_split
    from mtbert.export.variant import CHECK_BATCH, first_rows
    from mtbert.model.saved import load_model

    values: dict[str, dict[str, np.ndarray]] = {task: {} for task in members}
    for name in sorted({member for order in members.values() for member in order}):
        model, _ = load_model(models_dir / name)
        for task, order in members.items():
            if name in order:
                values[task][name] = predict_split(model, first_rows(dev[name][task], rows), CHECK_BATCH,
                                                   torch.device("cpu"))
        del model
        gc.collect()
    return {task: average(values[task], order) for task, order in members.items()}


def split_tokens(ensemble: ExportedEnsemble, task: str, splits: dict[str, TaskSplit]) -> dict:
    """Each of the task's members' rows as it reads them: its own tokenized split, in its encoding."""
    return {name: token_lists(splits[name], ensemble.predictors[name].tasks[task].encoding)
            for name in dict.fromkeys(ensemble.order(task))}


def latency(predictor, texts: dict[str, list[tuple[str, ...]]]) -> dict:
    """p50 milliseconds of one text per task (a sentence, or a pair) from raw text, and texts per second
    over each task's `texts` in batches; the tasks `predictor` serves."""
    figures: dict = {"p50_ms": {}, "texts_per_second": {}}
    for name, rows in texts.items():
        if name not in predictor.tasks:  # a member that serves other tasks only
            continue
        predictor.values(name, rows[:1])  # sessions loaded, buffers allocated
        times = []
        for text in (rows * LATENCY_CALLS)[:LATENCY_CALLS]:
            started = time.perf_counter()
            predictor.values(name, [text])
            times.append(time.perf_counter() - started)
        figures["p50_ms"][name] = round(1000 * statistics.median(times), 3)
        started = time.perf_counter()
        predictor.values(name, rows)
        figures["texts_per_second"][name] = round(len(rows) / (time.perf_counter() - started), 1)
        predictor.release(name)
    return figures


def dev_texts(tokenized_dir: Path, tasks: dict, rows: int) -> dict[str, list[tuple[str, ...]]]:
    """The first `rows` texts of each task's dev split (the tokenized split keeps them beside the ids)."""
    texts = {}
    for name, task in tasks.items():
        table = io.read_parquet(tokenized_path(tokenized_dir, name, "dev"), task.text_columns,
                                "run `dvc repro tokenize` again").slice(0, rows)
        texts[name] = list(zip(*(table.column(c).to_pylist() for c in task.text_columns), strict=True))
    return texts
