"""Saving models in reloadable formats, and resume checkpoints that survive a kill.

A finished model is a folder: `encoder/` (save_pretrained, with its tokenizer), one more save_pretrained
folder per other encoder of its arch (`encoder-<task>/`, `encoder-static/`), `heads.safetensors` and
`mtbert.json` (the merged params). A resume checkpoint is one torch file with the model, optimiser,
scheduler, RNG and sampler state, loaded with weights_only=True. Both are written atomically.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from stages.core import io
from stages.core.encoders import SHARED_DIR
from stages.core.model import MultitaskModel

log = logging.getLogger(__name__)
CONFIG_FILE = "mtbert.json"
HEADS_FILE = "heads.safetensors"


def save_model(model: MultitaskModel, tokenizer, out_dir: Path, config: dict) -> None:
    """Write the model folder next to out_dir, then swap it in, so out_dir is never half-written."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}."))
    try:
        model.encoders.save(temp, tokenizer)
        heads = {name: tensor.detach().contiguous() for name, tensor in model.heads.state_dict().items()}
        save_file(heads, str(temp / HEADS_FILE))
        (temp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        replace_dir(temp, out_dir)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def replace_dir(new: Path, target: Path) -> None:
    old = target.with_name(f".{target.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        os.replace(target, old)
    os.replace(new, target)
    shutil.rmtree(old, ignore_errors=True)


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


def rng_state() -> dict:
    """Torch's global generators drive dropout; data order comes from seeded numpy Generators instead."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: Path, state: dict) -> None:
    with io.atomic_path(path) as temp:
        torch.save(state, temp)


def load_checkpoint(path: Path, fingerprint: str) -> dict | None:
    """The saved state if it belongs to this exact run (same params and data), else None."""
    path = Path(path)
    if not path.is_file():
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("fingerprint") != fingerprint:
        log.warning("ignoring %s: it was written by a run with other params or data", path)
        return None
    return state
