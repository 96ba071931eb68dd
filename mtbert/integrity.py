"""Manifests of a folder's files: the sha256 of each, written beside them and checked before use.

    write_manifest(folder, {"format": 1, ...})   # folder/manifest.json: the contents and {"files": {path: sha256}}
    manifest = verify(folder, ["tokenizer.json"])  # those files checked (all listed ones without a list)

A file that is missing, or whose bytes are not the ones the manifest was written for, is an IntegrityError
naming it. The manifest guards itself too: its `digest` is the sha256 of the rest of it, so a changed entry
(a pad id, a column's name, a file's hash) is refused, not read. Imports nothing heavy: the ONNX engine
checks its export with it before loading a graph.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from mtbert.runtime import UserError

MANIFEST_FILE = "manifest.json"
DIGEST = "digest"  # the manifest's own sha256, of its other keys


class IntegrityError(UserError, ValueError):
    """A folder's manifest is missing or unreadable, or a file it lists is missing or changed."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def folder_files(folder: Path, manifest_name: str = MANIFEST_FILE) -> list[str]:
    """Every regular file under `folder` (but the manifest), as sorted POSIX paths relative to it."""
    return sorted(path.relative_to(folder).as_posix() for path in folder.rglob("*")
                  if path.is_file() and path.relative_to(folder).as_posix() != manifest_name)


def write_manifest(folder: Path | str, contents: dict, manifest_name: str = MANIFEST_FILE) -> dict:
    """Write `contents` plus `files` (the sha256 of every file now in `folder`) as the folder's manifest,
    atomically; returns what was written."""
    from mtbert import io  # here: io imports pyarrow, which the readers of manifests never need

    folder = Path(folder)
    if "files" in contents or DIGEST in contents:
        raise ValueError(f"a manifest's `files` and `{DIGEST}` are computed, not given")
    manifest = {**contents, "files": {name: sha256_file(folder / name) for name in folder_files(folder, manifest_name)}}
    manifest[DIGEST] = contents_digest(manifest)
    io.write_json(folder / manifest_name, manifest)
    return manifest


def contents_digest(manifest: dict) -> str:
    """The sha256 of a manifest's keys but its digest, as canonical JSON (a JSON round trip keeps it)."""
    rest = {key: value for key, value in manifest.items() if key != DIGEST}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def read_manifest(folder: Path | str, manifest_name: str = MANIFEST_FILE) -> dict:
    path = Path(folder) / manifest_name
    if not path.is_file():
        raise IntegrityError(f"{path} is missing; expected the manifest written with the folder's files")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        manifest = None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise IntegrityError(f"{path}: not a manifest (expected a JSON object with `files`, each file's sha256)")
    if DIGEST not in manifest:
        raise IntegrityError(f"{path} has no `{DIGEST}` (written by an older mtbert); write the folder again")
    if manifest[DIGEST] != contents_digest(manifest):
        raise IntegrityError(f"{path}: its contents do not match its `{DIGEST}`: the manifest changed after it "
                             "was written (write the folder again)")
    return manifest


def verify(folder: Path | str, names: Iterable[str] | None = None, manifest_name: str = MANIFEST_FILE) -> dict:
    """The folder's manifest, after checking the sha256 of the files `names` (default: every listed file)."""
    folder = Path(folder)
    manifest = read_manifest(folder, manifest_name)
    listed = manifest["files"]
    for name in listed if names is None else names:
        path = folder / name
        if name not in listed:
            raise IntegrityError(f"{path}: not listed in {folder / manifest_name}; expected one of its files")
        if not path.is_file():
            raise IntegrityError(f"{path} is missing; {folder / manifest_name} lists it")
        actual = sha256_file(path)
        if actual != listed[name]:
            raise IntegrityError(f"{path} has sha256 {actual}, but {folder / manifest_name} expects "
                                 f"{listed[name]}: the file changed after it was written (write the folder again)")
    return manifest
