"""Saving trained models in reloadable formats (resume checkpoints are in stages/core/training/resume.py).

A finished model is a folder: `encoder/` (save_pretrained, with its tokenizer), one more save_pretrained
folder per other encoder of its arch (`encoder-<task>/`, `encoder-static/`), `heads.safetensors` and
`mtbert.json` (the merged params). It is written beside its place and swapped in, so never half-written.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from stages.core import io
from stages.core.model.architectures import SHARED_DIR
from stages.core.model.multitask import MultitaskModel
from stages.core.runtime import UserError

CONFIG_FILE = "mtbert.json"
HEADS_FILE = "heads.safetensors"


class ModelFolderError(UserError, ValueError):
    """A model folder is missing, incomplete, or was not written by this project's `train`."""


def save_model(model: MultitaskModel, tokenizer, out_dir: Path, config: dict) -> None:
    """Write the model folder next to out_dir, then swap it in, so out_dir is never half-written."""
    with io.atomic_dir(out_dir) as temp:
        model.encoders.save(temp, tokenizer)
        heads = {name: tensor.detach().contiguous() for name, tensor in model.heads.state_dict().items()}
        save_file(heads, str(temp / HEADS_FILE))
        (temp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def load_model(model_dir: Path) -> tuple[MultitaskModel, dict]:
    """A trained model folder back as a MultitaskModel (in eval mode), with its saved config."""
    from transformers import AutoModel

    from stages.core.data.tasks import tasks_from_params
    from stages.core.params import ModelSpec, ParamsError, parse_section

    model_dir = Path(model_dir)
    config_path = model_dir / CONFIG_FILE
    for required in (config_path, model_dir / HEADS_FILE, model_dir / SHARED_DIR / "config.json"):
        if not required.is_file():
            raise ModelFolderError(f"{required} is missing; expected a model folder written by `train` "
                                   "(run `dvc repro train@<variant>`)")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
        saved = config["params"]
    except (ValueError, KeyError, TypeError):
        saved = None
    if not isinstance(saved, dict):
        raise ModelFolderError(f"{config_path}: not an mtbert model config (expected JSON with a 'params' "
                               "section, as `train` writes)")
    if not saved.get("tasks"):
        raise ModelFolderError(f"{config_path}: declares no tasks (a model folder from an older mtbert, "
                               "before tasks were params? retrain it)")
    # Only the tasks, heads and arch shape the model; the other sections may have grown since it was saved.
    try:
        spec = parse_section(ModelSpec, {"tasks": saved.get("tasks"), "heads": saved.get("heads")}, "",
                             source=str(config_path))
    except ParamsError as error:
        raise ModelFolderError(f"{error} (a model folder from another version of mtbert? retrain it)") from None
    encoder = AutoModel.from_pretrained(model_dir / SHARED_DIR, attn_implementation="sdpa")
    model = MultitaskModel(encoder, tasks_from_params(spec.tasks), spec.heads,
                           saved.get("model", {}).get("arch", "shared"), saved.get("model", {}).get("task_layers", 0))
    model.encoders.load_extra(model_dir)
    model.heads.load_state_dict(load_file(str(model_dir / HEADS_FILE)))
    return model.eval(), config
