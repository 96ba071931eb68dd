"""Checked reads of the files in a model folder (a trained variant's, a snapshot's, a local backbone's).

A file cut short, damaged or of the wrong kind stops the command with one line naming it and what was
expected, rather than with a library's traceback (`SafetensorError: incomplete metadata`, a JSON error
with no file name) or, worse, nothing: transformers builds a five-token tokenizer from a folder whose
tokenizer.json is gone, which maps every word to [UNK]. The checks read headers and small JSON files
only, never the weights twice.
"""

from __future__ import annotations

from pathlib import Path

from mtbert import io
from mtbert.runtime import UserError

# The JSON files transformers reads from a save_pretrained folder (the model's and the tokenizer's).
CONFIG_FILE = "config.json"
TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")

RESTORE = "restore the folder (e.g. `dvc checkout`) or write it again"


class ModelFolderError(UserError, ValueError):
    """A model folder is missing, incomplete, holds a file cut short, damaged or not what it should be, or
    was not written by this project's `train`."""


def check_json_files(folder: Path, names: tuple[str, ...], remedy: str = RESTORE) -> None:
    """Each of `names` that is in `folder` parses as JSON."""
    for name in names:
        if (Path(folder) / name).is_file():
            io.read_json(Path(folder) / name, f"expected the JSON `save_pretrained` writes as {name}: {remedy}",
                         ModelFolderError)


def check_safetensors(path: Path, remedy: str = RESTORE) -> None:
    """A safetensors file whose header parses and whose data is exactly what the header describes: a file
    cut short fails here, from its header alone."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt"):
            pass
    except (SafetensorError, OSError) as error:
        detail = str(error).removeprefix("Error while deserializing header: ")
        raise ModelFolderError(f"{path}: not a whole safetensors file ({detail}); expected the weights as they "
                               f"were written: {remedy}") from error


def load_safetensors(path: Path, remedy: str = RESTORE) -> dict:
    """The tensors of a checked safetensors file."""
    from safetensors.torch import load_file

    if not Path(path).is_file():
        raise ModelFolderError(f"{path} is missing; expected a safetensors file: {remedy}")
    check_safetensors(path, remedy)
    return load_file(str(path))


def check_weights_folder(folder: Path, remedy: str = RESTORE) -> None:
    """A save_pretrained folder's config and every safetensors file in it, before transformers reads them."""
    check_json_files(folder, (CONFIG_FILE,), remedy)
    for weights in sorted(Path(folder).glob("*.safetensors")):
        check_safetensors(weights, remedy)


def load_local_encoder(folder: Path, remedy: str = RESTORE, name: str = "", **kwargs):
    """A save_pretrained encoder from a local folder, its files checked first, with its family's attention
    (mtbert/model/families.py; an unknown family fails naming `name`, model.name, or else the folder)."""
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModel

    from mtbert.model.families import family_of

    check_weights_folder(folder, remedy)
    try:
        config = AutoConfig.from_pretrained(folder)
        family = family_of(config, name or str(folder))
        return AutoModel.from_pretrained(folder, config=config, attn_implementation=family.attention, **kwargs)
    except (OSError, ValueError, KeyError, SafetensorError) as error:
        if isinstance(error, UserError):
            raise
        raise ModelFolderError(f"{folder}: cannot load the encoder saved there ({type(error).__name__}: "
                               f"{first_line(error)}); expected a folder `save_pretrained` wrote: {remedy}") from error


def load_local_tokenizer(folder: Path, remedy: str = RESTORE, **kwargs):
    """A save_pretrained tokenizer from a local folder: its JSON files checked first, its vocabulary after."""
    from transformers import AutoTokenizer

    check_json_files(folder, (CONFIG_FILE, *TOKENIZER_JSON_FILES), remedy)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    except Exception as error:  # the tokenizers library raises a bare Exception for a file it cannot parse
        raise ModelFolderError(f"{folder}: cannot load the tokenizer saved there ({type(error).__name__}: "
                               f"{first_line(error)}); expected the files `save_pretrained` writes: "
                               f"{remedy}") from error
    check_vocabulary(folder, tokenizer, remedy)
    return tokenizer


def check_vocabulary(folder: Path, tokenizer, remedy: str = RESTORE) -> None:
    """The folder holds one of the files the tokenizer's vocabulary comes from (for BERT: tokenizer.json or
    vocab.txt); without any, transformers builds a tokenizer of its special tokens alone."""
    names = sorted(set(getattr(tokenizer, "vocab_files_names", {}).values()))
    if names and not any((Path(folder) / name).is_file() for name in names):
        raise ModelFolderError(f"{folder}: no tokenizer vocabulary (expected {' or '.join(names)}, as "
                               f"`save_pretrained` writes; without it every word would be [UNK]): {remedy}")


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""
