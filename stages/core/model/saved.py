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

CONFIG_FILE = "mtbert.json"
HEADS_FILE = "heads.safetensors"


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

    from stages.core.params import HeadsParams, parse_section

    model_dir = Path(model_dir)
    config_path = model_dir / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} is missing; expected a model folder written by `train`")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    # Only the heads and the arch shape the model; the other sections may have grown since it was saved.
    heads = parse_section(HeadsParams, config["params"].get("heads"), "heads", source=str(config_path))
    model_section = config["params"].get("model", {})
    encoder = AutoModel.from_pretrained(model_dir / SHARED_DIR, attn_implementation="sdpa")
    model = MultitaskModel(encoder, heads, model_section.get("arch", "shared"), model_section.get("task_layers", 0))
    model.encoders.load_extra(model_dir)
    model.heads.load_state_dict(load_file(str(model_dir / HEADS_FILE)))
    return model.eval(), config
