"""Masked-LM further pretraining: masking statistics, whole-word masking, a real short run, resume, pass-through."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file
from typer.testing import CliRunner

from mtbert.data.batches import TokenColumn
from mtbert.data.masking import IGNORE_INDEX, MaskingVocab, mask_tokens
from mtbert.io import rounded
from mtbert.model.backbone import PROVENANCE_FILE, starting_point
from mtbert.params_file import load_params
from mtbert.training.loop import Paths
from stages.pretrain import app, pretrain
from tests.conftest import REPO_ROOT, attention_runs, kill_once_checkpointed, module_folder


@pytest.fixture(scope="module")
def vocab(tokenizer) -> MaskingVocab:
    return MaskingVocab.from_tokenizer(tokenizer)


def padded_batch(tokenizer, rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """[CLS] random ordinary tokens [SEP], then padding; row lengths vary from 3 to 60."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 61, (rows,), generator=generator)
    ids = torch.full((rows, 60), tokenizer.pad_token_id)
    ids[:, 1:] = torch.randint(1000, 30000, (rows, 59), generator=generator)
    ids[:, 0] = tokenizer.cls_token_id
    positions = torch.arange(60)[None, :]
    ids[positions == (lengths[:, None] - 1)] = tokenizer.sep_token_id
    mask = (positions < lengths[:, None]).long()
    ids[mask == 0] = tokenizer.pad_token_id
    return ids, mask


def test_masking_chooses_15_percent_then_80_10_10_and_never_special_or_padding(tokenizer, vocab):
    ids, mask = padded_batch(tokenizer, 256)
    generator = torch.Generator().manual_seed(1)
    counts = dict.fromkeys(("eligible", "chosen", "mask", "random", "unchanged", "touched_other"), 0)
    eligible = mask.bool() & (ids != tokenizer.cls_token_id) & (ids != tokenizer.sep_token_id)
    for _ in range(40):
        corrupted, labels = mask_tokens(ids, mask, vocab, mask_prob=0.15, whole_word=False, generator=generator)
        chosen = labels != IGNORE_INDEX
        assert torch.equal(labels[chosen], ids[chosen])
        counts["eligible"] += int(eligible.sum())
        counts["chosen"] += int(chosen.sum())
        counts["mask"] += int((chosen & (corrupted == tokenizer.mask_token_id)).sum())
        counts["unchanged"] += int((chosen & (corrupted == ids)).sum())
        counts["random"] += int((chosen & (corrupted != ids) & (corrupted != tokenizer.mask_token_id)).sum())
        counts["touched_other"] += int((~eligible & (chosen | (corrupted != ids))).sum())
        assert not vocab.special[corrupted[chosen & (corrupted != tokenizer.mask_token_id)]].any()
    assert counts["touched_other"] == 0  # [CLS], [SEP] and padding are never chosen nor changed
    assert counts["chosen"] / counts["eligible"] == pytest.approx(0.15, abs=0.004)
    assert counts["mask"] / counts["chosen"] == pytest.approx(0.8, abs=0.01)
    assert counts["random"] / counts["chosen"] == pytest.approx(0.1, abs=0.01)
    assert counts["unchanged"] / counts["chosen"] == pytest.approx(0.1, abs=0.01)


def test_masking_is_a_function_of_the_generator(tokenizer, vocab):
    ids, mask = padded_batch(tokenizer, 8)
    first = mask_tokens(ids, mask, vocab, mask_prob=0.15, whole_word=False,
                        generator=torch.Generator().manual_seed(5))
    again = mask_tokens(ids, mask, vocab, mask_prob=0.15, whole_word=False,
                        generator=torch.Generator().manual_seed(5))
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_whole_word_masking_takes_every_piece_of_a_word_together(tokenizer, vocab):
    text = "unaffable tokenization of hyperparameters is embarrassingly uncharacteristic"
    encoded = tokenizer([text] * 64, return_tensors="pt")
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    words = encoded.word_ids(0)  # the tokenizer's own word of each piece (None for specials)
    assert len([w for w in words if w is not None]) > len(set(w for w in words if w is not None))  # multi-piece
    generator = torch.Generator().manual_seed(2)
    chosen_words = total_words = 0
    for _ in range(20):
        _, labels = mask_tokens(ids, mask, vocab, mask_prob=0.15, whole_word=True, generator=generator)
        chosen = (labels != IGNORE_INDEX).numpy()
        for word in set(w for w in words if w is not None):
            pieces = chosen[:, [i for i, w in enumerate(words) if w == word]]
            assert (pieces.all(axis=1) | ~pieces.any(axis=1)).all(), f"word {word} split"
            chosen_words += int(pieces[:, 0].sum())
            total_words += len(pieces)
        assert not chosen[:, [i for i, w in enumerate(words) if w is None]].any()
    assert chosen_words / total_words == pytest.approx(0.15, abs=0.03)


def test_token_column_concat_take_and_truncation_keeping_the_last_token():
    a = TokenColumn(np.array([101, 5, 6, 102, 101, 7, 102]), np.array([0, 4, 7]))
    b = TokenColumn(np.array([101, 8, 9, 10, 11, 102]), np.array([0, 6]))
    both = TokenColumn.concat([a, b])
    assert both.lengths().tolist() == [4, 3, 6]
    taken = both.take(np.array([2, 0]))
    assert taken.values.tolist() == [101, 8, 9, 10, 11, 102, 101, 5, 6, 102]
    ids, mask = both.padded_to(np.array([0, 1, 2]), max_length=4)
    assert ids.tolist() == [[101, 5, 6, 102], [101, 7, 102, 0], [101, 8, 9, 102]]
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]]


def pretrain_params(tmp_path: Path, backbone: Path, **pretrain) -> Path:
    from tests.conftest import make_params

    path = make_params(tmp_path, backbone, Path("unused"))
    raw = yaml.safe_load(path.read_text())
    raw["pretrain"].update({"enabled": True, "steps": 24, "batch_size": 8, "lr": 1e-3, "eval_every": 8,
                            "eval_examples": 0, "bucket_batches": 2, "warmup_fraction": 0.1, **pretrain})
    raw["runtime"].update({"threads": 1, "checkpoint_every": {"train": 3, "pretrain": 8}})
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def paths_in(root: Path, tokenized: Path) -> Paths:
    return Paths(tokenized=tokenized, model_out=root / "pretrained", metrics_out=root / "pretrain.json",
                 live_dir=root / "live", checkpoints=root / "ck")


def encoder_weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def finished_run(request, tmp_path_factory, tiny_backbone, tiny_tokenized):
    """A whole short run: its folder, its summary, and what attention its encoder ran (attention_runs)."""
    root = module_folder(request, tmp_path_factory, "pretrain")
    params = load_params(pretrain_params(root, tiny_backbone))
    with attention_runs() as attention:
        summary = pretrain(params, paths_in(root, tiny_tokenized))
    return root, summary, attention


@pytest.mark.slow(reason="a finished masked-LM run (the `finished_run` fixture)")
def test_short_run_lowers_held_out_perplexity_and_writes_a_loadable_encoder(finished_run, tiny_backbone):
    from transformers import AutoModel

    root, summary, _ = finished_run
    assert summary["after"]["perplexity"] < 0.5 * summary["before"]["perplexity"]
    assert [r["step"] for r in summary["history"]] == [0, 8, 16, 24]
    assert summary["held_out"]["masked_tokens"] > 0 and not summary["head_from_checkpoint"]
    trained, original = encoder_weights(root / "pretrained"), encoder_weights(tiny_backbone)
    assert trained.keys() == original.keys()
    assert torch.equal(trained["pooler.dense.weight"], original["pooler.dense.weight"])  # MLM leaves it
    assert not torch.equal(trained["encoder.layer.1.output.dense.weight"],
                           original["encoder.layer.1.output.dense.weight"])
    AutoModel.from_pretrained(root / "pretrained")
    assert json.loads((root / "pretrained" / PROVENANCE_FILE).read_text())["pretrained"] is True
    assert starting_point(str(tiny_backbone), root / "pretrained") == str(root / "pretrained")
    assert not (root / "ck").exists()


@pytest.mark.slow(reason="pretrains twice, one run crashed")
def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path, finished_run, tiny_backbone, tiny_tokenized):
    root, summary, _ = finished_run
    params = load_params(pretrain_params(tmp_path, tiny_backbone))
    assert pretrain(params, paths_in(tmp_path, tiny_tokenized), stop_after=8) is None
    assert (tmp_path / "ck" / "last.pt").is_file() and not (tmp_path / "pretrained").exists()
    torch.manual_seed(12345)  # a fresh process would not share the first run's RNG
    resumed = pretrain(params, paths_in(tmp_path, tiny_tokenized))
    strip = lambda s: {k: v for k, v in s.items() if k != "speed"}  # noqa: E731
    assert strip(resumed) == strip(summary)
    trained, again = encoder_weights(root / "pretrained"), encoder_weights(tmp_path / "pretrained")
    assert all(torch.equal(trained[k], again[k]) for k in trained)


def pretrain_command(params: Path, root: Path, tokenized: Path) -> list[str]:
    return [sys.executable, "-m", "stages.pretrain", "--params-file", str(params), "--tokenized-dir", str(tokenized),
            "--out-dir", str(root / "pretrained"), "--metrics-file", str(root / "pretrain.json"),
            "--live-dir", str(root / "live"), "--checkpoints-dir", str(root / "ck")]


@pytest.mark.slow(reason="pretrains twice, one run killed with SIGKILL")
def test_pretrain_killed_with_kill_9_resumes_to_the_uninterrupted_result(tmp_path, finished_run, tiny_backbone,
                                                                         tiny_tokenized):
    root, summary, _ = finished_run
    command = pretrain_command(pretrain_params(tmp_path, tiny_backbone), tmp_path, tiny_tokenized)
    kill_once_checkpointed(command, tmp_path / "ck" / "last.pt")  # at step 8 of 24
    assert not (tmp_path / "pretrained").exists()
    subprocess.run(command, cwd=REPO_ROOT, check=True, capture_output=True)
    resumed = json.loads((tmp_path / "pretrain.json").read_text())
    resumed.pop("speed")
    assert resumed == rounded({k: v for k, v in summary.items() if k != "speed"})
    trained, again = encoder_weights(root / "pretrained"), encoder_weights(tmp_path / "pretrained")
    assert all(torch.equal(trained[k], again[k]) for k in trained)
    assert not (tmp_path / "ck").exists()


def test_whole_word_run_trains(tmp_path, tiny_backbone, tiny_tokenized):
    params = load_params(pretrain_params(tmp_path, tiny_backbone, whole_word=True, steps=8, eval_every=8))
    summary = pretrain(params, paths_in(tmp_path, tiny_tokenized))
    assert summary["after"]["loss"] < summary["before"]["loss"]


@pytest.mark.slow(reason="a finished masked-LM run (the `finished_run` fixture)")
def test_pretraining_keeps_the_fused_attention_kernel_in_both_modes(finished_run):
    # unlike fine-tuning on a CPU (mtbert/model/architectures.py `attention_for`): eager attention measured
    # slower for masked-LM steps, so pretraining never switches
    _, _, attention = finished_run
    assert attention == {(True, "sdpa"), (False, "sdpa")}


def test_disabled_stage_passes_the_backbone_through_unchanged(tmp_path, tiny_backbone, tiny_tokenized):
    params = pretrain_params(tmp_path, tiny_backbone, enabled=False)
    out = tmp_path / "pretrained"
    result = CliRunner().invoke(app, ["--params-file", str(params), "--tokenized-dir", str(tiny_tokenized),
                                      "--out-dir", str(out), "--metrics-file", str(tmp_path / "m.json"),
                                      "--live-dir", str(tmp_path / "live"), "--checkpoints-dir",
                                      str(tmp_path / "ck")])
    assert result.exit_code == 0, result.output
    original, copied = encoder_weights(tiny_backbone), encoder_weights(out)
    assert original.keys() == copied.keys() and all(torch.equal(original[k], copied[k]) for k in original)
    assert json.loads((tmp_path / "m.json").read_text()) == {"enabled": False, "backbone": str(tiny_backbone)}
    assert (out / "tokenizer.json").is_file()


def test_train_refuses_a_pretrained_folder_from_another_backbone(tmp_path, tiny_backbone):
    from mtbert.model.backbone import BackboneError

    folder = tmp_path / "pretrained"
    folder.mkdir()
    (folder / PROVENANCE_FILE).write_text(json.dumps({"backbone": "bert-base-uncased", "pretrained": True}))
    with pytest.raises(BackboneError, match=r"made from 'bert-base-uncased' but this variant's model.name is"):
        starting_point(str(tiny_backbone), folder)
    with pytest.raises(BackboneError, match="dvc repro pretrain"):
        starting_point(str(tiny_backbone), tmp_path / "missing")
