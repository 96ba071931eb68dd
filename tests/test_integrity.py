"""Manifests (mtbert/integrity.py): the sha256 of a folder's files and of the manifest itself, checked before
a file is used. The folders' own tests (exports, model folders) cut and alter their files
(tests/test_properties.py); these hold the manifest's digest to what it promises."""

from __future__ import annotations

import json

import pytest

from mtbert.integrity import MANIFEST_FILE, IntegrityError, verify, write_manifest


def test_a_manifest_written_again_with_its_keys_in_another_order_still_verifies(tmp_path):
    """Its digest is of its content (canonical JSON), not of how a tool laid the file out."""
    (tmp_path / "graph.onnx").write_bytes(b"weights")
    write_manifest(tmp_path, {"format": 1, "tokenizer": "tokenizer.json", "tasks": {"sst": {"kind": "classes"}}})
    manifest = json.loads((tmp_path / MANIFEST_FILE).read_text())
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(dict(reversed(list(manifest.items()))), indent=4))
    assert verify(tmp_path)["tasks"] == {"sst": {"kind": "classes"}}


def test_a_manifest_entry_changed_after_it_was_written_is_refused_in_one_line(tmp_path):
    (tmp_path / "graph.onnx").write_bytes(b"weights")
    write_manifest(tmp_path, {"format": 1, "pad_id": 0})
    manifest = json.loads((tmp_path / MANIFEST_FILE).read_text())
    (tmp_path / MANIFEST_FILE).write_text(json.dumps({**manifest, "pad_id": 1}))
    with pytest.raises(IntegrityError) as refused:
        verify(tmp_path)
    assert str(refused.value) == (f"{tmp_path / MANIFEST_FILE}: its contents do not match its `digest`: the manifest "
                                  "changed after it was written (write the folder again)")


def written_folder(folder):
    (folder / "graphs").mkdir()
    (folder / "graphs" / "sst.onnx").write_bytes(b"weights of sst")
    (folder / "tokenizer.json").write_text('{"vocab": {}}')
    return write_manifest(folder, {"format": 1})


def test_the_manifest_lists_every_file_under_the_folder_but_itself(tmp_path):
    assert list(written_folder(tmp_path)["files"]) == ["graphs/sst.onnx", "tokenizer.json"]
    assert verify(tmp_path)["format"] == 1 and verify(tmp_path, ["tokenizer.json"])["format"] == 1


@pytest.mark.parametrize("change", ["altered", "removed", "unlisted"])
def test_a_file_changed_removed_or_not_listed_is_refused_naming_it(tmp_path, change):
    manifest = written_folder(tmp_path)
    path = tmp_path / "graphs" / "sst.onnx"
    if change == "altered":
        path.write_bytes(b"weights of sts")
    elif change == "removed":
        path.unlink()
    names = ["graphs/extra.onnx"] if change == "unlisted" else None
    with pytest.raises(IntegrityError) as refused:
        verify(tmp_path, names)
    expected = {
        "altered": f"{path} has sha256 ", "removed": f"{path} is missing; {tmp_path / MANIFEST_FILE} lists it",
        "unlisted": f"{tmp_path / 'graphs' / 'extra.onnx'}: not listed in {tmp_path / MANIFEST_FILE}; expected one "
                    "of its files"}[change]
    assert str(refused.value).startswith(expected) and "\n" not in str(refused.value)
    if change == "altered":
        assert str(refused.value).endswith(f"but {tmp_path / MANIFEST_FILE} expects "
                                           f"{manifest['files']['graphs/sst.onnx']}: the file changed after it was "
                                           "written (write the folder again)")


@pytest.mark.parametrize("manifest", ["missing", "not JSON", "no files", "no digest"])
def test_a_manifest_missing_unreadable_or_incomplete_is_refused_in_one_line(tmp_path, manifest):
    written = written_folder(tmp_path)
    path = tmp_path / MANIFEST_FILE
    if manifest == "missing":
        path.unlink()
    elif manifest == "not JSON":
        path.write_bytes(b"\xff{")
    elif manifest == "no files":
        path.write_text(json.dumps({"format": 1}))
    else:
        path.write_text(json.dumps({key: value for key, value in written.items() if key != "digest"}))
    with pytest.raises(IntegrityError) as refused:
        verify(tmp_path)
    assert str(refused.value) == {
        "missing": f"{path} is missing; expected the manifest written with the folder's files",
        "not JSON": f"{path}: not a manifest (expected a JSON object with `files`, each file's sha256)",
        "no files": f"{path}: not a manifest (expected a JSON object with `files`, each file's sha256)",
        "no digest": f"{path} has no `digest` (written by an older mtbert); write the folder again"}[manifest]


def test_computed_keys_cannot_be_given(tmp_path):
    for key in ("files", "digest"):
        with pytest.raises(ValueError, match="a manifest's `files` and `digest` are computed, not given"):
            write_manifest(tmp_path, {key: {}})


@pytest.mark.parametrize("name", [MANIFEST_FILE, "checksums.json"])
def test_a_manifest_written_again_lists_the_files_not_the_manifest_before_it(tmp_path, name):
    written_folder(tmp_path)
    write_manifest(tmp_path, {"format": 1}, manifest_name=name)
    (tmp_path / "tokenizer.json").write_text('{"vocab": {"a": 0}}')
    again = write_manifest(tmp_path, {"format": 2}, manifest_name=name)  # the old manifest is in the folder
    others = ["graphs/sst.onnx", "tokenizer.json"] + ([MANIFEST_FILE] if name != MANIFEST_FILE else [])
    assert list(again["files"]) == sorted(others)
    assert verify(tmp_path, manifest_name=name)["format"] == 2
