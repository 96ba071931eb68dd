"""Deployed models side by side (figure 8c of `python -m bench`; alone: `python -m bench.side_by_side`):
every export against the first, the baseline (the default's exports/ensemble), measured in the same run.

- one sentence's and one pair's latency (p50, p95) and batched texts/s from raw dev text, all the exports
  loaded in one fresh process without torch and taking turns (bench/exports_engines.py);
- `mtbert serve` on each export in turn under `clients` concurrent clients of one-sentence requests:
  p50 and p99 latency, requests/s, every response counted, and the server's peak resident memory.

Each figure is also given as a ratio over the baseline's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import typer

from bench import options
from bench.deploy import server_figures
from mtbert import io
from mtbert.deploy.engine import load_export
from mtbert.export.ensemble import dev_texts

app = typer.Typer(add_completion=False)


def engine_figures(exports: dict[str, Path], texts: dict, sentence: str, pair: str, *, threads: int,
                   batch_size: int, calls: int, rounds: int) -> dict:
    job = {"exports": {name: str(folder) for name, folder in exports.items()}, "texts": texts,
           "sentence_task": sentence, "pair_task": pair, "threads": threads, "batch_size": batch_size,
           "calls": calls, "rounds": rounds}
    result = subprocess.run([sys.executable, "-m", "bench.exports_engines"], input=json.dumps(job), text=True,
                            capture_output=True)
    if result.returncode != 0:
        raise RuntimeError(f"bench.exports_engines failed: {result.stderr.strip()[-2000:]}")
    return json.loads(result.stdout)


def headline(figures: dict, name: str) -> dict:
    served = figures["server"][name]
    return {"single_sentence_p50": figures["single_sentence_ms"][name]["p50"],
            "single_pair_p50": figures["single_pair_ms"][name]["p50"],
            "texts_per_second": figures["texts_per_second"][name],
            "served_requests_per_second": served["requests_per_second"], "server_peak_rss": served["peak_rss_mib"]}


def over_baseline(figures: dict, baseline: str) -> dict:
    """Each export's headline figures over the baseline's: > 1 means more time, more texts/s, more memory."""
    base = headline(figures, baseline)
    return {name: {key: round(value / base[key], 3) if value and base[key] else None
                   for key, value in headline(figures, name).items()}
            for name in figures["texts_per_second"]}


def shared_tasks(exports: dict[str, Path]) -> dict:
    """The tasks that every export serves, in the baseline's order. A member's folder inside an ensemble's
    export holds only the tasks the ensemble gave that member."""
    served = [load_export(folder).tasks for folder in exports.values()]
    return {name: task for name, task in served[0].items() if all(name in tasks for tasks in served)}


def task_with_columns(tasks: dict, columns: int, exports: dict[str, Path]) -> str:
    """The first task whose input is `columns` texts; a one-line error when no task every export serves is."""
    for name, task in tasks.items():
        if len(task.text_columns) == columns:
            return name
    kind = "one-sentence" if columns == 1 else "pair"
    named = ", ".join(f"{name}={folder}" for name, folder in exports.items())
    raise typer.BadParameter(f"no {kind} task is served by every export ({named}); they share "
                             f"{sorted(tasks) or 'no task'}")


def side_by_side_figures(exports: dict[str, Path], tokenized_dir: Path, *, threads: int, batch_size: int = 128,
                         texts_per_task: int = 1000, single_calls: int = 200, rounds: int = 2, clients: int = 64,
                         requests: int = 20, scratch: Path) -> dict:
    baseline = next(iter(exports))
    tasks = shared_tasks(exports)
    texts = dev_texts(tokenized_dir, tasks, texts_per_task)
    sentence, pair = task_with_columns(tasks, 1, exports), task_with_columns(tasks, 2, exports)
    print(f"  {', '.join(exports)} in one fresh process: one {sentence} sentence and one {pair} pair x "
          f"{single_calls} calls, {sum(map(len, texts.values()))} dev rows x {rounds} rounds ...", flush=True)
    figures = {"baseline": baseline, "exports": {name: str(folder) for name, folder in exports.items()},
               "threads": threads, "tasks": {"sentence": sentence, "pair": pair},
               **engine_figures(exports, texts, sentence, pair, threads=threads, batch_size=batch_size,
                                calls=single_calls, rounds=rounds)}
    figures["server"] = {}
    for name, folder in exports.items():
        print(f"  mtbert serve --model {folder}: {clients} clients x {requests} requests ...", flush=True)
        (scratch / name).mkdir()
        figures["server"][name] = server_figures(["--model", folder], sentence, texts[sentence], clients, requests,
                                                 workers=1, threads=threads, scratch=scratch / name)
    figures["over_baseline"] = over_baseline(figures, baseline)
    return figures


def report(f: dict) -> None:
    """Figure 8c, as `python -m bench` prints it."""
    print(f"8c. deployed models side by side ({f['threads']} threads; ratios over {f['baseline']})")
    for name in f["texts_per_second"]:
        s, r = f["server"][name], f["over_baseline"][name]
        print(f"   {name}: one sentence p50 {f['single_sentence_ms'][name]['p50']:.2f} ms "
              f"({r['single_sentence_p50']}x), one pair p50 {f['single_pair_ms'][name]['p50']:.2f} ms "
              f"({r['single_pair_p50']}x); batched {f['texts_per_second'][name]} texts/s ({r['texts_per_second']}x)")
        print(f"   {' ' * len(name)}  mtbert serve, {s['clients']} clients: answered {s['answered']}; p50 "
              f"{s['latency_ms']['p50']} ms, p99 {s['latency_ms']['p99']} ms, {s['requests_per_second']} requests/s "
              f"({r['served_requests_per_second']}x); peak RSS {s['peak_rss_mib']} MiB ({r['server_peak_rss']}x)")


def parse_exports(values: list[str]) -> dict[str, Path]:
    exports = {}
    for value in values:
        name, _, folder = value.partition("=")
        if not name or not folder or not (Path(folder) / "manifest.json").is_file():
            raise typer.BadParameter(f"{value!r}: expected NAME=FOLDER, an export folder with a manifest.json")
        exports[name] = Path(folder)
    return exports


@app.command()
def main(export: list[str] = typer.Option(..., "--export", help="NAME=FOLDER, repeated; the first is the baseline"),
         tokenized_dir: Path = options.TOKENIZED_DIR,
         threads: int = typer.Option(0, help="ONNX Runtime threads (0: every core)"),
         texts_per_task: int = options.TEXTS_PER_TASK,
         single_calls: int = options.SINGLE_CALLS,
         rounds: int = options.ROUNDS,
         clients: int = typer.Option(64, min=1, help="concurrent clients of each server"),
         requests: int = typer.Option(20, min=1, help="requests per client"),
         json_out: Path = typer.Option(Path("metrics/bench-side-by-side.json"))) -> None:
    """Figure 8c alone (see the module docstring)."""
    exports = parse_exports(export)
    with tempfile.TemporaryDirectory() as scratch:
        figures = side_by_side_figures(exports, tokenized_dir, threads=threads, texts_per_task=texts_per_task,
                                       single_calls=single_calls, rounds=rounds, clients=clients,
                                       requests=requests, scratch=Path(scratch))
    report(figures)
    io.write_json(json_out, figures)


if __name__ == "__main__":
    app()
