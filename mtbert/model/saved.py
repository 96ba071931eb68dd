"""Saving trained models in reloadable formats (resume checkpoints are in mtbert/training/checkpoint.py).

A snapshot (the model as it was after one epoch) is a folder: `encoder/` (save_pretrained, with its
tokenizer), one more save_pretrained folder per other encoder of its arch (`encoder-<task>/`,
`encoder-static/`), `heads.safetensors` and `mtbert.json` (the merged params).

A trained variant (`models/<variant>/`) keeps each task at the epoch it chose: `mtbert.json` with
`task_epochs` (task -> epoch) and one snapshot folder `epoch-<E>/` per distinct chosen epoch. Where tasks
share layers (every arch but `independent`), each task needs the shared layers of its own epoch, so a
snapshot is kept whole; `checksums.json` records the sha256 of every file (mtbert/integrity.py). Folders
are written beside their place and swapped in, never half-written. Loading a variant checks every file
before the libraries read it (mtbert/model/files.py), then every file's sha256: a file cut short, damaged,
or changed since `train` wrote it (a bad copy, a flipped block) is one line naming it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import save_file
from torch import nn

from mtbert import io
from mtbert.integrity import verify, write_manifest
from mtbert.model.architectures import SHARED_DIR
from mtbert.model.card import CARD_FILE, student_card
from mtbert.model.files import ModelFolderError, load_local_encoder, load_safetensors
from mtbert.model.multitask import MultitaskModel

CONFIG_FILE = "mtbert.json"
HEADS_FILE = "heads.safetensors"
# The sha256 of every file of a variant's folder (an export's is its manifest.json, which also says what it is).
CHECKSUMS_FILE = "checksums.json"
# The layout of a variant's folder; 2: per-task epochs in epoch-<E>/ snapshot folders; 3: with checksums.json.
MODEL_FORMAT = 3
# What to do about a model folder whose file is cut short or damaged.
RESTORE_OR_RETRAIN = "restore the folder (`dvc checkout`) or retrain the variant (`dvc repro train@<variant>`)"


def save_model(model: MultitaskModel, tokenizer, out_dir: Path, config: dict) -> None:
    """Write the model folder next to out_dir, then swap it in, so out_dir is never half-written."""
    with io.atomic_dir(out_dir) as temp:
        model.encoders.save(temp, tokenizer)
        heads = {name: tensor.detach().contiguous() for name, tensor in model.heads.state_dict().items()}
        save_file(heads, str(temp / HEADS_FILE))
        (temp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def epoch_dir(epoch: int) -> str:
    return f"epoch-{epoch}"


def assemble_model(out_dir: Path, snapshots_dir: Path, task_epochs: dict[str, int], config: dict,
                   card: str | None = None) -> None:
    """A variant's model folder from the snapshots <snapshots_dir>/epoch-<E>/ its tasks chose, with its
    model card."""
    with io.atomic_dir(out_dir) as temp:
        for epoch in sorted(set(task_epochs.values())):
            shutil.copytree(snapshots_dir / epoch_dir(epoch), temp / epoch_dir(epoch))
        config = {"format": MODEL_FORMAT, **config, "task_epochs": task_epochs}
        (temp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        if card is not None:
            (temp / CARD_FILE).write_text(card, encoding="utf-8")
        write_checksums(temp)


def write_checksums(model_dir: Path) -> None:
    """Record the sha256 of every file of a variant's folder, last, once its files are as they will stay."""
    write_manifest(model_dir, {"format": MODEL_FORMAT}, CHECKSUMS_FILE)


class TaskSnapshots(nn.Module):
    """A trained variant whose tasks come from different epochs: each task runs on its epoch's snapshot.

    It answers what `predict_split` and the stages ask of a MultitaskModel: `tasks`, `family`,
    `encoding(task)`, `forward(task, batch)` and `predictions(task, outputs)`.
    """

    def __init__(self, snapshots: dict[int, MultitaskModel], task_epochs: dict[str, int]):
        super().__init__()
        self.snapshots = nn.ModuleDict({str(epoch): model for epoch, model in snapshots.items()})
        self.task_epochs = dict(task_epochs)
        first = next(iter(snapshots.values()))
        self.tasks, self.family = first.tasks, first.family

    def for_task(self, task: str) -> MultitaskModel:
        return self.snapshots[str(self.task_epochs[task])]

    def forward(self, task: str, batch):
        return self.for_task(task)(task, batch)

    def predictions(self, task: str, outputs):
        return self.for_task(task).predictions(task, outputs)

    def encoding(self, task: str) -> str:
        return self.for_task(task).encoding(task)


def load_model(model_dir: Path) -> tuple[MultitaskModel | TaskSnapshots, dict]:
    """A trained variant's folder (or one snapshot folder) back as a model in eval mode, with its config:
    a MultitaskModel when every task chose the same epoch, else a TaskSnapshots."""
    model_dir = Path(model_dir)
    config = read_config(model_dir / CONFIG_FILE)
    task_epochs = config.get("task_epochs")
    if task_epochs is None:
        return load_snapshot(model_dir)
    if config.get("format") != MODEL_FORMAT:
        raise ModelFolderError(f"{model_dir / CONFIG_FILE}: a model folder of format {config.get('format')!r}; "
                               f"this mtbert reads format {MODEL_FORMAT} (retrain it, or use the mtbert that wrote it)")
    if not isinstance(task_epochs, dict) or not all(isinstance(e, int) for e in task_epochs.values()):
        raise ModelFolderError(f"{model_dir / CONFIG_FILE}: task_epochs must map each task to an epoch number")
    snapshots = {epoch: load_snapshot(model_dir / epoch_dir(epoch))[0] for epoch in sorted(set(task_epochs.values()))}
    missing = [task for task in next(iter(snapshots.values())).tasks if task not in task_epochs]
    if missing:
        raise ModelFolderError(f"{model_dir / CONFIG_FILE}: task_epochs names no epoch for task {missing[0]!r}")
    # After loading, so a file cut short is named by what is wrong with it; the manifest catches the rest.
    verify(model_dir, manifest_name=CHECKSUMS_FILE)
    if len(snapshots) == 1:
        return next(iter(snapshots.values())), config
    return TaskSnapshots(snapshots, task_epochs).eval(), config


def tokenizer_dir(model_dir: Path, config: dict) -> Path:
    """Where a trained folder's tokenizer is: saved with its (first kept epoch's) shared encoder."""
    if "task_epochs" in config:
        model_dir = Path(model_dir) / epoch_dir(min(config["task_epochs"].values()))
    return Path(model_dir) / SHARED_DIR


def read_config(config_path: Path) -> dict:
    if not config_path.is_file():
        raise ModelFolderError(f"{config_path} is missing; expected a model folder written by `train` "
                               "(run `dvc repro train@<variant>`)")
    expected = "not an mtbert model config (expected JSON with a 'params' section, as `train` writes)"
    config = io.read_json(config_path, expected, ModelFolderError)
    if not isinstance(config, dict) or not isinstance(config.get("params"), dict):
        raise ModelFolderError(f"{config_path}: {expected}")
    return config


def load_snapshot(model_dir: Path) -> tuple[MultitaskModel, dict]:
    """One snapshot folder back as a MultitaskModel (in eval mode), with its saved config."""
    from mtbert.data.tasks import tasks_from_params
    from mtbert.params import ModelSpec, ParamsError
    from mtbert.params_file import parse_section

    config_path = model_dir / CONFIG_FILE
    for required in (config_path, model_dir / HEADS_FILE, model_dir / SHARED_DIR / "config.json"):
        if not required.is_file():
            raise ModelFolderError(f"{required} is missing; expected a model folder written by `train` "
                                   "(run `dvc repro train@<variant>`)")
    config = read_config(config_path)
    saved = config["params"]
    if not saved.get("tasks"):
        raise ModelFolderError(f"{config_path}: declares no tasks (a model folder from an older mtbert, "
                               "before tasks were params? retrain it)")
    # Only the tasks, heads and arch shape the model; the other sections may have grown since it was saved.
    try:
        spec = parse_section(ModelSpec, {"tasks": saved.get("tasks"), "heads": saved.get("heads")}, "",
                             source=str(config_path))
    except ParamsError as error:
        raise ModelFolderError(f"{error} (a model folder from another version of mtbert? retrain it)") from None
    encoder = load_local_encoder(model_dir / SHARED_DIR, RESTORE_OR_RETRAIN)
    model = MultitaskModel(encoder, tasks_from_params(spec.tasks), spec.heads,
                           saved.get("model", {}).get("arch", "shared"), saved.get("model", {}).get("task_layers", 0))
    model.encoders.load_extra(model_dir, RESTORE_OR_RETRAIN)
    load_heads(model, model_dir / HEADS_FILE, config_path)
    return model.eval(), config


def load_heads(model: MultitaskModel, heads_path: Path, config_path: Path) -> None:
    """The heads' weights, which must be those of the heads mtbert.json declares."""
    heads = load_safetensors(heads_path, RESTORE_OR_RETRAIN)
    try:
        model.heads.load_state_dict(heads)
    except RuntimeError as error:  # missing, unexpected or misshapen weights
        detail = " ".join(str(error).split())
        raise ModelFolderError(f"{heads_path}: not the heads {config_path.name} declares ({detail[:300]}); "
                               f"{RESTORE_OR_RETRAIN}") from None


def describe_student(model_dir: Path, summary: dict, params, record: dict) -> None:
    """A distilled student's folder records what taught it (`record`, in its config) and its card says it;
    its checksums are then written anew, of the files as they now are."""
    from mtbert.data.tasks import tasks_from_params

    config = json.loads((model_dir / CONFIG_FILE).read_text(encoding="utf-8"))
    io.write_json(model_dir / CONFIG_FILE, {**config, "distill": record})
    card = student_card(summary, config["params"], tasks_from_params(params.tasks), str(model_dir), record)
    io.write_text(model_dir / CARD_FILE, card)
    write_checksums(model_dir)
