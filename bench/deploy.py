"""Speed of the deployed model (figure 8 of `python -m bench`; alone: `python -m bench.deploy`), every
engine measured in the same run:

- cold start of a `mtbert predict` call: a fresh process, from its start to its first result on stdout,
  on the export (its default engine: no torch) and on the trained folder (PyTorch, today's path), the
  median of a few calls each;
- one sentence's latency (p50, p95) and batched sentences/s from raw dev text, for PyTorch (the engine of
  `mtbert predict` on a trained folder, fp32) in this process, and ONNX fp32 and int8 in a fresh process
  that never imports torch, as they are deployed; engines in one process alternate call by call and round
  by round, so a change in the machine's speed hits them alike;
- a bounded load test of `mtbert serve` on loopback: a fixed number of concurrent clients each sending a
  fixed number of one-sentence requests, then the server is stopped: p50 and p99 latency, requests/s, and
  every response counted by status (or the client error that replaced it).

int8's dev metrics against fp32's are the export's own measurement (metrics/export/<model>.json), shown
beside these when it is there. Needs models/<model> and exports/<model> (`dvc repro export@<model>`)
and data/tokenized/base.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import typer

from bench import options
from bench.common import load_test, peak_rss_mib, start_server, stop_server, verdict
from bench.latency import batched_rates, single_sentence_ms
from mtbert.export.ensemble import dev_texts

TARGETS = {"cold_start_seconds": 1.5, "single_sentence_p50_ms": 5.0, "batched_speedup": 2.0}
app = typer.Typer(add_completion=False)


# --- the engines ----------------------------------------------------------------------------------------
def torch_engine(model_dir: Path, threads: int, batch_size: int):
    """PyTorch on the trained folder (`mtbert predict --engine torch`), in this process."""
    from mtbert.predictors import load_predictor

    return load_predictor(model=model_dir, ensemble=None, models_dir=model_dir.parent, engine="torch",
                          batch_size=batch_size, threads=threads)


def onnx_engines_measured(export_dir: Path, task: str, texts: dict[str, list], *, threads: int, batch_size: int,
                          calls: int, rounds: int) -> dict:
    """The export's engines measured in a fresh process that never imports torch, as `mtbert predict` and
    `mtbert serve` run them (bench/onnx_engines.py). Beside a PyTorch engine in the same process they are
    slower than deployed: PyTorch's OpenMP threads keep spinning after each of its calls."""
    job = {"export_dir": str(export_dir), "task": task, "texts": texts, "threads": threads,
           "batch_size": batch_size, "calls": calls, "rounds": rounds}
    result = subprocess.run([sys.executable, "-m", "bench.onnx_engines"], input=json.dumps(job), text=True,
                            capture_output=True)
    if result.returncode != 0:
        raise RuntimeError(f"bench.onnx_engines failed: {result.stderr.strip()[-2000:]}")
    return json.loads(result.stdout)


# --- fresh processes ---------------------------------------------------------------------------------
def cold_start_seconds(folder: Path, task: str, sentence: str, threads: int, runs: int) -> float:
    """Median seconds from starting `mtbert predict` to its first line on stdout."""
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        process = subprocess.Popen([sys.executable, "-m", "mtbert.cli", "predict", "--model", str(folder), "--task",
                                    task, "--threads", str(threads), sentence], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        first = process.stdout.readline()
        elapsed = time.perf_counter() - started
        _, errors = process.communicate()
        if process.returncode != 0 or not first:
            raise RuntimeError(f"mtbert predict --model {folder} failed: {errors.strip()}")
        times.append(elapsed)
    return round(statistics.median(times), 3)


def server_figures(source: list, task: str, sentences: list, clients: int, requests: int, workers: int,
                   threads: int, scratch: Path, log_name: str = "serve.log") -> dict:
    """`mtbert serve <source>` (e.g. `--model exports/ensemble`) loaded by `clients` clients sending
    `requests` requests each: its start, throughput, latency and peak memory."""
    started = time.perf_counter()
    process, url = start_server(scratch / log_name, *source, "--workers", workers, "--threads", threads)
    ready = time.perf_counter() - started
    try:
        figures = load_test(url, task, sentences, clients, requests)
        memory = peak_rss_mib(process.pid)
    finally:
        stop_server(process)
    return {"workers": workers, "threads_per_worker": threads, "start_seconds": round(ready, 2), **figures,
            "peak_rss_mib": memory}


# --- the figure ----------------------------------------------------------------------------------------
def deploy_figures(model_dir: Path, export_dir: Path, tokenized_dir: Path, *, threads: int, batch_size: int = 128,
                   texts_per_task: int = 1000, single_calls: int = 200, rounds: int = 2, cold_starts: int = 3,
                   clients: int = 8, requests: int = 50, workers: int = 1, export_metrics: Path | None = None,
                   scratch: Path) -> dict:
    torch = torch_engine(model_dir, threads, batch_size)
    tasks = torch.tasks
    texts = dev_texts(tokenized_dir, tasks, texts_per_task)
    single = next(name for name, task in tasks.items() if len(task.text_columns) == 1)
    print(f"  ONNX engines in a fresh process: one sentence of {single} x {single_calls} calls, "
          f"{sum(map(len, texts.values()))} dev rows x {rounds} rounds ...", flush=True)
    onnx = onnx_engines_measured(export_dir, single, texts, threads=threads, batch_size=batch_size,
                                 calls=single_calls, rounds=rounds)
    print("  PyTorch, the same ...", flush=True)
    figures: dict = {"engines": ["torch", *onnx["engines"]], "threads": threads, "batch_size": batch_size,
                     "onnx_process_imported_torch": onnx["torch_imported"],
                     "single_sentence_ms": {**single_sentence_ms({"torch": torch}, single, texts[single],
                                                                 single_calls), **onnx["single_sentence_ms"]}}
    rates = {**batched_rates({"torch": torch}, texts, rounds), **onnx["sentences_per_second"]}
    figures["sentences_per_second"] = rates
    figures["speedup_over_torch"] = {name: round(rate / rates["torch"], 2) for name, rate in rates.items()
                                     if name != "torch"}
    del torch
    sentence = texts[single][0][0]
    print(f"  cold start of mtbert predict, {cold_starts} calls each ...", flush=True)
    figures["cold_start_seconds"] = {"export": cold_start_seconds(export_dir, single, sentence, threads, cold_starts),
                                     "torch": cold_start_seconds(model_dir, single, sentence, threads, cold_starts)}
    print(f"  mtbert serve under load: {clients} clients x {requests} requests ...", flush=True)
    figures["server"] = server_figures(["--model", export_dir], single, texts[single], clients, requests, workers,
                                       threads, scratch)
    if export_metrics is not None and export_metrics.is_file():
        report = json.loads(export_metrics.read_text(encoding="utf-8"))
        figures["export"] = {key: report[key] for key in ("engine", "reason", "dev", "int8_drop") if key in report}
    figures["targets"] = TARGETS
    return figures


def ensemble_figures(ensemble_dir: Path, ensemble_file: Path, tokenized_dir: Path, *, threads: int,
                     batch_size: int = 128, texts_per_task: int = 1000, single_calls: int = 200, rounds: int = 2,
                     clients: int = 64, requests: int = 20, scratch: Path) -> dict:
    """Figure 8b, the deployed ensemble (exports/ensemble): one sentence's and one pair's latency and batched
    texts/s, against the same members assembled apart and its first member alone, in a fresh process
    (bench/ensemble_engines.py); then `mtbert serve` at `clients` clients, on the export against today's
    `--ensemble` over the members' exports."""
    from mtbert.deploy.engine import ExportedEnsemble

    tasks = ExportedEnsemble.load(ensemble_dir).tasks
    texts = dev_texts(tokenized_dir, tasks, texts_per_task)
    sentence = next(name for name, task in tasks.items() if len(task.text_columns) == 1)
    pair = next(name for name, task in tasks.items() if len(task.text_columns) == 2)
    job = {"ensemble_dir": str(ensemble_dir), "ensemble_file": str(ensemble_file), "texts": texts,
           "sentence_task": sentence, "pair_task": pair, "threads": threads, "batch_size": batch_size,
           "calls": single_calls, "rounds": rounds}
    print(f"  the exported ensemble in a fresh process: one {sentence} sentence and one {pair} pair x "
          f"{single_calls} calls, {sum(map(len, texts.values()))} dev rows x {rounds} rounds ...", flush=True)
    result = subprocess.run([sys.executable, "-m", "bench.ensemble_engines"], input=json.dumps(job), text=True,
                            capture_output=True)
    if result.returncode != 0:
        raise RuntimeError(f"bench.ensemble_engines failed: {result.stderr.strip()[-2000:]}")
    figures = {"threads": threads, "tasks": {"sentence": sentence, "pair": pair}, **json.loads(result.stdout)}
    print(f"  mtbert serve under load: {clients} clients x {requests} requests, the export and the members "
          "apart ...", flush=True)
    figures["server"] = {
        name: server_figures(source, sentence, texts[sentence], clients, requests, 1, threads, scratch,
                             log_name=f"serve-{name}.log")
        for name, source in (("ensemble", ["--model", ensemble_dir]),
                             ("members_apart", ["--ensemble", ensemble_file, "--models-dir", ensemble_dir]))}
    served = figures["server"]
    figures["server"]["ensemble_over_members_apart"] = round(
        served["ensemble"]["requests_per_second"] / served["members_apart"]["requests_per_second"], 3)
    return figures


def report_ensemble(f: dict) -> None:
    """Figure 8b, as `python -m bench` prints it."""
    print(f"8b. the deployed ensemble, exports/ensemble ({f['threads']} threads; one member: {f['first_member']})")
    for name in f["texts_per_second"]:
        print(f"   {name:13s} one sentence p50 {f['single_sentence_ms'][name]['p50']:.2f} ms, one pair p50 "
              f"{f['single_pair_ms'][name]['p50']:.2f} ms; batched {f['texts_per_second'][name]} texts/s")
    for name in ("ensemble", "members_apart"):
        s = f["server"][name]
        print(f"   mtbert serve ({name}): {s['sent']} requests from {s['clients']} clients, answered "
              f"{s['answered']}; p50 {s['latency_ms']['p50']} ms, p99 {s['latency_ms']['p99']} ms, "
              f"{s['requests_per_second']} requests/s")
    print(f"   served requests/s, the export over the members apart: {f['server']['ensemble_over_members_apart']}x")


def report(f: dict) -> None:
    """Figure 8, as `python -m bench` prints it."""
    ms, rates = f["single_sentence_ms"], f["sentences_per_second"]
    cold, best = f["cold_start_seconds"], max(f["speedup_over_torch"].values())
    print(f"8. deployment ({f['threads']} threads): cold start of mtbert predict {cold['export']:.2f} s on the export "
          f"vs {cold['torch']:.2f} s on PyTorch {verdict(cold['export'], TARGETS['cold_start_seconds'], False)}")
    for name in f["engines"]:
        print(f"   {name:5s} one sentence p50 {ms[name]['p50']:.2f} ms, p95 {ms[name]['p95']:.2f} ms; "
              f"batched {rates[name]} sentences/s" + (f" = {f['speedup_over_torch'][name]:.2f}x PyTorch"
                                                       if name != "torch" else ""))
    p50 = min(ms[name]["p50"] for name in f["engines"] if name != "torch")
    print(f"   fastest ONNX one-sentence p50 {p50:.2f} ms {verdict(p50, TARGETS['single_sentence_p50_ms'], False)}; "
          f"batched {best:.2f}x PyTorch {verdict(best, TARGETS['batched_speedup'], True)}")
    s = f["server"]
    print(f"   mtbert serve ({s['workers']} worker(s)): {s['sent']} requests from {s['clients']} clients, answered "
          f"{s['answered']} (all accounted for: {s['accounted_for']}); p50 {s['latency_ms']['p50']} ms, "
          f"p99 {s['latency_ms']['p99']} ms, {s['requests_per_second']} requests/s; peak RSS of the server's "
          f"processes {s['peak_rss_mib']} MiB")
    if "export" in f and "int8" in f["export"].get("dev", {}):
        dev = f["export"]["dev"]
        print(f"   int8 vs fp32 dev (the export's): overall {dev['int8']['overall']:.4f} vs "
              f"{dev['onnx']['overall']:.4f}, drops {f['export']['int8_drop']}; default engine "
              f"{f['export']['engine']}: {f['export']['reason']}")


@app.command()
def main(name: str = typer.Option("", "--model", help="a name in export.models, or `ensemble` for exports/ensemble "
                                                     "(default: the first of export.models, else the ensemble)"),
         params_file: Path = typer.Option(Path("params.yaml")),
         models_dir: Path = typer.Option(Path("models")),
         exports_dir: Path = typer.Option(Path("exports")),
         tokenized_dir: Path = options.TOKENIZED_DIR,
         texts_per_task: int = options.TEXTS_PER_TASK,
         single_calls: int = options.SINGLE_CALLS,
         rounds: int = options.ROUNDS,
         cold_starts: int = typer.Option(3, min=1, help="fresh `mtbert predict` processes per folder"),
         clients: int = typer.Option(8, min=1, help="concurrent clients of the load test"),
         requests: int = typer.Option(50, min=1, help="requests per client"),
         workers: int = typer.Option(1, min=1, help="server processes"),
         json_out: Path = typer.Option(Path("metrics/bench-deploy.json"))) -> None:
    """Figure 8 alone: the deployed engines and the server (see the module docstring)."""
    import tempfile

    from mtbert import io
    from mtbert.params_file import load_params

    params = load_params(params_file)
    name = name or next(iter(params.export.models), "ensemble")
    threads = params.runtime.threads
    if name == "ensemble":  # the default deployable model: figure 8b
        with tempfile.TemporaryDirectory() as scratch:
            figures = ensemble_figures(exports_dir / "ensemble", Path("metrics/ensemble.json"), tokenized_dir,
                                       threads=threads, texts_per_task=texts_per_task, single_calls=single_calls,
                                       rounds=rounds, clients=clients, requests=requests, scratch=Path(scratch))
        report_ensemble(figures)
        io.write_json(json_out, figures)
        return
    with tempfile.TemporaryDirectory() as scratch:
        figures = deploy_figures(models_dir / name, exports_dir / name, tokenized_dir, threads=threads,
                                 texts_per_task=texts_per_task, single_calls=single_calls, rounds=rounds,
                                 cold_starts=cold_starts, clients=clients, requests=requests, workers=workers,
                                 export_metrics=Path("metrics/export") / f"{name}.json", scratch=Path(scratch))
    report(figures)
    io.write_json(json_out, figures)


if __name__ == "__main__":
    app()
