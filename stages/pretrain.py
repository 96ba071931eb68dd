"""Stage `pretrain`: optional masked-LM further pretraining of the backbone on the tasks' own text.

Enabled (`pretrain.enabled`), it trains the backbone with a masked-LM head on every sentence of the
`pretrain.corpus` splits (each sentence of a pair alone; BERT's 15% / 80-10-10 masking, no
next-sentence task), measures the masked-LM loss and perplexity on held-out dev sentences with fixed
masks every `eval_every` steps, and writes the trained encoder to models/pretrained/<variant>/ in Hugging
Face format. Disabled, it writes the backbone itself there, unchanged. `train@<variant>` always starts from
models/pretrained/<variant>/: per variant, since a variant may have its own encoder and pretraining. The
loop is mtbert/training/masked_lm.py.

Resume: every runtime.checkpoint_every.pretrain steps the full state goes atomically to
checkpoints/pretrain/<variant>/; a killed run started again continues from it and ends as an uninterrupted run would.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import typer

from mtbert import layout
from mtbert.params import Params
from mtbert.params_file import load_params, variant_params
from mtbert.runtime import limit_memory_growth, run_app, setup_logging
from mtbert.training import masked_lm
from mtbert.training.distributed import relaunch_with_torchrun, setup_process, shutdown, under_torchrun
from mtbert.training.loop import Paths

log = logging.getLogger("pretrain")
app = typer.Typer(add_completion=False)


def pretrain(params: Params, paths: Paths, stop_after: int | None = None) -> dict | None:
    """Set up this process, then train from the last checkpoint (or the start) to pretrain.steps;
    `stop_after` ends early after a checkpoint, returning None (a graceful stand-in for a kill)."""
    limit_memory_growth(params.runtime.onednn_cache, params.runtime.malloc_threshold_mb)
    ranks, device = setup_process(params.pretrain.seed, params.runtime.threads)
    fingerprint = masked_lm.run_fingerprint(params, paths.tokenized, ranks.world_size)
    run = masked_lm.prepare(params, paths, ranks, device, fingerprint)
    summary = masked_lm.train(run, masked_lm.resume(run), stop_after)
    if summary is not None:
        shutdown(ranks)
    return summary


@app.command()
def main(variant: str | None = typer.Option(None, "--variant", help="a key of `models:` [default: every variant; "
                                                                     "with --out-dir: the shared sections]"),
         params_file: Path = typer.Option(Path("params.yaml")),
         tokenized_dir: Path | None = typer.Option(None, help="[default: data/tokenized/<variant>]"),
         out_dir: Path | None = typer.Option(None, help="[default: models/pretrained/<variant>]"),
         metrics_file: Path | None = typer.Option(None, help="[default: metrics/pretrain/<variant>.json]"),
         live_dir: Path | None = typer.Option(None, help="[default: metrics/pretrain/<variant>]"),
         checkpoints_dir: Path | None = typer.Option(None, help="[default: checkpoints/pretrain/<variant>]")) -> None:
    setup_logging()
    if variant is None and out_dir is None:
        layout.run_every_variant("stages.pretrain", params_file, load_params(params_file).models)
        return
    params = variant_params(params_file, variant) if variant else load_params(params_file)
    if params.pretrain.enabled and params.pretrain.nproc > 1 and not under_torchrun():
        relaunch_with_torchrun(params.pretrain.nproc, "stages.pretrain", sys.argv[1:])
    paths = Paths(tokenized=layout.tokenized_of(variant, tokenized_dir),
                  model_out=layout.pretrained_of(variant, out_dir),
                  metrics_out=layout.of_variant(layout.PRETRAIN_METRICS, variant, metrics_file),
                  live_dir=layout.of_variant(layout.PRETRAIN_LIVE, variant, live_dir),
                  checkpoints=layout.of_variant(layout.PRETRAIN_CHECKPOINTS, variant, checkpoints_dir))
    if not params.pretrain.enabled:
        masked_lm.pass_through(params, paths)
        return
    summary = pretrain(params, paths)
    if summary:  # the main rank's
        log.info("done: held-out perplexity %.2f -> %.2f", summary["before"]["perplexity"],
                 summary["after"]["perplexity"])


if __name__ == "__main__":
    run_app(app)
