"""Two small trained variants, their `predict` dumps, the ensemble over them and their exports, made by the
pipeline's own stages, for the tests of the deployment (export, the ONNX engine, the server, the benchmark).
The variants and the ensemble are built once (`trained`), then the variants' own exports (`deployed`), then the
ensemble's export (`ensemble_export`), whose members are the variants' own exports copied, once per session.

The variants are built from the 2-layer backbone with perturbed weights instead of trained (a folder as
`train` writes it, in seconds), and between them cover every task kind and encoding: `cross` (one shared
encoder, CLS pooling: SST classification, QQP binary and STS regression as cross-encoded pairs) and `bi`
(CerBERTus with one task layer, mean pooling, QQP kept at another epoch than the others: QQP a bi-encoder
over [u, v, |u-v|, u*v], STS the cosine bi-encoder).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from typer.testing import CliRunner

from tests.conftest import make_params

VARIANTS = {
    "cross": {},
    "bi": {"model": {"arch": "cerbertus", "task_layers": 1},
           "heads": {"sst": {"pooling": "mean"},
                     "qqp": {"pooling": "mean", "encoding": "bi", "combine": "features"},
                     "sts": {"pooling": "mean", "encoding": "bi", "combine": "cosine"}}},
}
TASK_EPOCHS = {"cross": {"sst": 1, "qqp": 1, "sts": 1}, "bi": {"sst": 1, "qqp": 2, "sts": 1}}
# predict as the engines are compared (fp32, small batches: several widths); a quick export (one batch timed)
PARAMS = {"predict": {"batch_size": 8, "bf16": False},
          "export": {"check_rows": 16, "speed_rows": 8, "batch_size": 8}}


@dataclasses.dataclass(frozen=True)
class Deployed:
    root: Path
    params_file: Path
    tokenized: Path
    tokenized_root: Path  # <root>/<variant>: each variant's tokenized folder, as data/tokenized/ holds them
    models: Path  # models/<variant>/
    predictions: Path  # data/predictions/<variant>/
    ensemble_dir: Path  # the ensemble's dumps
    ensemble_file: Path  # metrics/ensemble.json
    exports: Path  # exports/<variant>/
    export_metrics: Path  # metrics/export/<variant>.json


def build(root: Path, backbone: Path, tokenized: Path) -> Deployed:
    """The variants, their dumps, the ensemble over them, and each variant's own export, in `root`."""
    return export_each(build_trained(root, backbone, tokenized), root)


def build_trained(root: Path, backbone: Path, tokenized: Path) -> Deployed:
    """The variants, their dumps and the ensemble over them, in `root`; not exported yet."""
    params_file = make_params(root, backbone, Path("unused"), models=VARIANTS, extra=PARAMS)
    deployed = Deployed(root=root, params_file=params_file, tokenized=tokenized,
                        tokenized_root=root / "tokenized", models=root / "models",
                        predictions=root / "predictions", ensemble_dir=root / "ensemble",
                        ensemble_file=root / "metrics" / "ensemble.json", exports=root / "exports",
                        export_metrics=root / "metrics" / "export")
    rejects = tokenized.parent / "rejects.tsv"
    for variant in VARIANTS:
        (deployed.tokenized_root / variant).parent.mkdir(parents=True, exist_ok=True)
        (deployed.tokenized_root / variant).symlink_to(tokenized)  # the variants share one encoder's tokens
        write_variant(deployed, variant, backbone)
        invoke("stages.predict", "--variant", variant, "--params-file", params_file, "--tokenized-dir", tokenized,
               "--rejects-file", rejects, "--models-dir", deployed.models, "--predictions-dir", deployed.predictions,
               "--metrics-dir", root / "metrics")
        snapshots = root / "snapshots" / variant
        snapshots.mkdir(parents=True)
        (snapshots / "chosen.json").write_text(json.dumps(TASK_EPOCHS[variant]))  # no other epochs' dumps
    invoke("stages.ensemble", "--params-file", params_file, "--tokenized-dir", tokenized, "--rejects-file", rejects,
           "--predictions-dir", deployed.predictions, "--snapshots-dir", root / "snapshots",
           "--out-dir", deployed.ensemble_dir, "--plots-dir", root / "plots", "--metrics-file", deployed.ensemble_file)
    return deployed


def export_each(trained: Deployed, folder: Path) -> Deployed:
    """Each variant of `trained` exported by the `export` stage into `folder`: `trained` with its exports."""
    deployed = dataclasses.replace(trained, exports=folder / "exports", export_metrics=folder / "metrics" / "export")
    for variant in VARIANTS:
        invoke("stages.export", "--model", variant, "--params-file", trained.params_file, "--tokenized-dir",
               trained.tokenized, "--models-dir", trained.models, "--exports-dir", deployed.exports,
               "--metrics-dir", deployed.export_metrics)
    return deployed


def export_ensemble(trained: Deployed, folder: Path, members_from: Deployed | None = None) -> tuple[Path, dict]:
    """exports/ensemble over `trained` as the `export_ensemble` stage writes it into `folder`, and its metrics.
    With `members_from`, a member exported for all its tasks is that fixture's export of it, copied."""
    copied: list[str] = []
    with contextlib.nullcontext() if members_from is None else exports_copied_from(members_from, copied):
        invoke("stages.export_ensemble", "--params-file", trained.params_file, "--tokenized-root",
               trained.tokenized_root, "--models-dir", trained.models, "--ensemble-file", trained.ensemble_file,
               "--dumps-dir", trained.ensemble_dir, "--out-dir", folder / "ensemble",
               "--metrics-file", folder / "ensemble.json")
    assert members_from is None or sorted(copied) == sorted(VARIANTS), f"members copied: {copied}"
    return folder / "ensemble", json.loads((folder / "ensemble.json").read_text())


@contextlib.contextmanager
def exports_copied_from(deployed: Deployed, copied: list[str]) -> Iterator[None]:
    """The export stage's export of a variant (its folder and report) stands in for the one the ensemble's
    export would make of it: the same function (export_variant) on the same model, tokens and options
    (neither variant overrides `export`), the work of a whole export saved. A member exported for some of
    its tasks only is exported anew."""
    from mtbert.export import ensemble

    made_here = ensemble.export_variant

    def export_variant(model_dir: Path, out_dir: Path, options, tokenized_dir: Path, threads: int = 0,
                       tasks: list[str] | None = None) -> dict:
        variant = model_dir.name
        all_tasks = tasks is None or set(tasks) == set(TASK_EPOCHS.get(variant, ()))
        if model_dir != deployed.models / variant or not all_tasks:
            return made_here(model_dir, out_dir, options, tokenized_dir, threads, tasks)
        shutil.copytree(deployed.exports / variant, out_dir)
        copied.append(variant)
        return json.loads((deployed.export_metrics / f"{variant}.json").read_text())

    ensemble.export_variant = export_variant
    try:
        yield
    finally:
        ensemble.export_variant = made_here


def write_variant(deployed: Deployed, variant: str, backbone: Path) -> None:
    """models/<variant>/ as `train` leaves it, each kept epoch's weights the backbone's plus noise."""
    from mtbert.data.tasks import tasks_from_params
    from mtbert.model.backbone import load_encoder, load_tokenizer
    from mtbert.model.multitask import MultitaskModel
    from mtbert.model.saved import assemble_model, epoch_dir, save_model
    from mtbert.params import as_dict
    from mtbert.params_file import variant_params
    from mtbert.training.build import NOT_TRAINING

    params = variant_params(deployed.params_file, variant)
    torch.manual_seed(len(variant))
    model = MultitaskModel(load_encoder(str(backbone)), tasks_from_params(params.tasks), params.heads,
                           params.model.arch, params.model.task_layers)
    config = {"variant": variant,
              "params": {key: value for key, value in as_dict(params).items() if key not in NOT_TRAINING}}
    epochs = deployed.root / "epochs" / variant
    for epoch in sorted(set(TASK_EPOCHS[variant].values())):
        with torch.no_grad():  # every copy of a layer distinct, as after training
            for parameter in model.parameters():
                parameter.add_(0.01 * torch.randn_like(parameter))
        save_model(model, load_tokenizer(str(backbone)), epochs / epoch_dir(epoch), config)
    assemble_model(deployed.models / variant, epochs, TASK_EPOCHS[variant], config)


def invoke(stage: str, *arguments) -> None:
    """A stage's command, in this process."""
    import importlib

    app = importlib.import_module(stage).app
    result = CliRunner().invoke(app, [str(argument) for argument in arguments])
    if result.exit_code != 0:
        import traceback

        raise AssertionError(f"{stage} failed: {result.output[-2000:]}\n"
                             + "".join(traceback.format_exception(*result.exc_info)))
