"""Stage `pretrain`: optional masked-LM further pretraining of the backbone on the tasks' own text.

Enabled (`pretrain.enabled`), it trains the backbone with a masked-LM head on every sentence of the
`pretrain.corpus` splits (each sentence of a pair alone; BERT's 15% / 80-10-10 masking, no
next-sentence task), measures the masked-LM loss and perplexity on held-out dev sentences with fixed
masks every `eval_every` steps, and writes the trained encoder to models/pretrained/ in Hugging Face
format. Disabled, it writes the backbone itself there, unchanged. `train` always starts from
models/pretrained/. The loop is stages/core/training/masked_lm.py.

Resume: every runtime.checkpoint_every.pretrain steps the full state goes atomically to
checkpoints/pretrain/; a killed run started again continues from it and ends as an uninterrupted run would.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import typer

from stages.core.params import load_params
from stages.core.runtime import run_app, setup_logging
from stages.core.training.distributed import relaunch_with_torchrun, under_torchrun
from stages.core.training.masked_lm import Pretrainer, pass_through
from stages.core.training.run import Paths

log = logging.getLogger("pretrain")
app = typer.Typer(add_completion=False)


@app.command()
def main(params_file: Path = typer.Option(Path("params.yaml")),
         tokenized_dir: Path = typer.Option(Path("data/tokenized")),
         out_dir: Path = typer.Option(Path("models/pretrained")),
         metrics_file: Path = typer.Option(Path("metrics/pretrain.json")),
         live_dir: Path = typer.Option(Path("metrics/pretrain")),
         checkpoints_dir: Path = typer.Option(Path("checkpoints/pretrain"))) -> None:
    setup_logging()
    params = load_params(params_file)
    if params.pretrain.enabled and params.pretrain.nproc > 1 and not under_torchrun():
        relaunch_with_torchrun(params.pretrain.nproc, "stages.pretrain", sys.argv[1:])
    paths = Paths(tokenized=tokenized_dir, model_out=out_dir, metrics_out=metrics_file, live_dir=live_dir,
                  checkpoints=checkpoints_dir)
    if not params.pretrain.enabled:
        pass_through(params, paths)
        return
    summary = Pretrainer(params, paths).run()
    if summary:  # the main rank's
        log.info("done: held-out perplexity %.2f -> %.2f", summary["before"]["perplexity"],
                 summary["after"]["perplexity"])


if __name__ == "__main__":
    run_app(app)
