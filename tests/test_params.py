import copy

import pytest
import yaml

from stages.core.params import ParamsError, load_params, parse_params
from tests.conftest import REPO_ROOT


@pytest.fixture
def raw_params() -> dict:
    return yaml.safe_load((REPO_ROOT / "params.yaml").read_text())


def test_repository_params_file_is_valid():
    params = load_params(REPO_ROOT / "params.yaml")
    assert params.tokenize.max_length == 128
    assert params.model.name == "sentence-transformers/all-MiniLM-L6-v2"
    names = ["sst", "qqp", "sts"]
    assert list(params.tasks) == list(params.heads) == names
    assert list(params.train.batch_size) == list(params.smart.task_lambda) == names
    assert params.heads["sts"].target == "raw" and params.heads["sst"].encoding is None
    assert params.runtime.threads == 2
    assert (params.runtime.checkpoint_every.train, params.runtime.checkpoint_every.pretrain) == (200, 250)


@pytest.mark.parametrize(("section", "key", "accepts"), [
    ("train", "threads", "train accepts: seed"),
    ("train", "checkpoint_every", "train accepts: seed"),
    ("pretrain", "threads", "pretrain accepts: enabled"),
    ("pretrain", "checkpoint_every", "pretrain accepts: enabled"),
    ("predict", "threads", "predict accepts: batch_size, bf16"),
])
def test_runtime_keys_of_the_old_sections_are_unknown_there(raw_params, section, key, accepts):
    raw_params[section][key] = 2
    with pytest.raises(ParamsError, match=f"unknown key '{section}.{key}'; {accepts}"):
        parse_params(raw_params)


def with_value(raw: dict, dotted_key: str, value) -> dict:
    raw = copy.deepcopy(raw)
    *parents, last = dotted_key.split(".")
    node = raw
    for parent in parents:
        node = node[parent]
    node[last] = value
    return raw


@pytest.mark.parametrize(("key", "value", "message"), [
    ("tokenize.max_length", "128", "tokenize.max_length: expected an integer, got '128'"),
    ("tokenize.max_length", 4, "tokenize.max_length: expected a value >= 8, got 4"),
    ("tokenize.batch_size", True, "tokenize.batch_size: expected an integer, got True"),
    ("data.max_reject_fraction", 1.5, "data.max_reject_fraction: expected a value <= 1.0, got 1.5"),
    ("data.max_reject_fraction", float("nan"), "data.max_reject_fraction: expected a finite number"),
    ("data.unescape_ptb", ["sst", "mnli"], "data.unescape_ptb: unknown task 'mnli'; tasks declares sst, qqp, sts"),
    ("data.unescape_ptb", "sst", "data.unescape_ptb: expected a list"),
    ("model.name", "", "model.name: expected a non-empty string"),
    ("smart.lambda", -1, "smart.lambda: expected a value >= 0.0, got -1"),
    ("smart.task_lambda.sst", "high", "smart.task_lambda.sst: expected a finite number, got 'high'"),
    ("smart.task_lambda.qqp", -1, "smart.task_lambda.qqp: expected a value >= 0.0, got -1"),
    ("train.batch_size.sts", 0, "train.batch_size.sts: expected a value >= 1, got 0"),
    ("train.batch_size.sst", 3.5, "train.batch_size.sst: expected an integer, got 3.5"),
    ("runtime.threads", -1, "runtime.threads: expected a value >= 0, got -1"),
    ("runtime.checkpoint_every.train", 0, "runtime.checkpoint_every.train: expected a value >= 1, got 0"),
    ("smart.norm", "l1", "smart.norm: expected one of 'inf', 'l2', got 'l1'"),
    ("smart.beta", 1.0, "smart.beta: expected a value < 1.0, got 1.0"),
    ("model", "bert", "model: expected a mapping"),
])
def test_bad_values_name_the_key_and_what_was_expected(raw_params, key, value, message):
    with pytest.raises(ParamsError, match=f"^params: {message}".replace("[", r"\[").replace("]", r"\]")):
        parse_params(with_value(raw_params, key, value))


def test_unknown_key_is_named_with_the_accepted_ones(raw_params):
    with pytest.raises(ParamsError, match=r"unknown key 'tokenize.max_len'; tokenize accepts: max_length"):
        parse_params(with_value(raw_params, "tokenize.max_len", 64))
    with pytest.raises(ParamsError, match=r"unknown key 'trian'"):
        parse_params({**raw_params, "trian": {}})


def test_missing_key_is_named(raw_params):
    del raw_params["tokenize"]["batch_size"]
    with pytest.raises(ParamsError, match=r"missing key 'tokenize.batch_size'"):
        parse_params(raw_params)


def test_unreadable_files_are_clear_errors(tmp_path):
    with pytest.raises(ParamsError, match="file not found"):
        load_params(tmp_path / "params.yaml")
    (tmp_path / "params.yaml").write_text("data: [unclosed\n")
    with pytest.raises(ParamsError, match="not valid YAML"):
        load_params(tmp_path / "params.yaml")


def test_variant_overrides_deep_merge_over_the_shared_sections(raw_params):
    from stages.core.params import variant_params

    raw_params["models"] = {"base": {}, "mean": {"heads": {"sst": {"pooling": "mean"}}, "train": {"seed": 7}}}
    base, mean = variant_params(raw_params, "base"), variant_params(raw_params, "mean")
    assert mean.heads["sst"].pooling == "mean" and mean.train.seed == 7
    assert mean.heads["sst"].dropout == base.heads["sst"].dropout  # siblings of an override are kept
    assert mean.heads["qqp"] == base.heads["qqp"] and mean.train.lr == base.train.lr
    assert mean.tasks == base.tasks


def test_bad_variant_override_names_the_variant_and_key(raw_params):
    raw_params["models"] = {"base": {}, "typo": {"train": {"lrr": 1.0}}}
    with pytest.raises(ParamsError, match=r"unknown key 'models.typo.train.lrr'; models.typo.train accepts: seed"):
        parse_params(raw_params)
    raw_params["models"] = {"bad name": {}}
    with pytest.raises(ParamsError, match=r"models.bad name: a variant name may use"):
        parse_params(raw_params)


def test_smart_lambda_is_keyed_as_in_params_yaml(raw_params):
    from stages.core.params import as_dict

    raw = with_value(raw_params, "smart.lambda", 10)
    raw["smart"]["task_lambda"] = {"sst": None, "qqp": 0, "sts": 2.5}
    params = parse_params(raw)
    assert params.smart.lambda_ == 10.0
    assert [params.smart.task_weight(t) for t in ("sst", "qqp", "sts")] == [10.0, 0.0, 2.5]
    assert as_dict(params)["smart"]["lambda"] == 10.0 and "lambda_" not in as_dict(params)["smart"]
    raw["smart"]["lambda_"] = raw["smart"].pop("lambda")
    with pytest.raises(ParamsError, match="unknown key 'smart.lambda_'; smart accepts: lambda, task_lambda"):
        parse_params(raw)


def test_pcgrad_needs_the_joint_sampler(raw_params):
    raw = with_value(with_value(raw_params, "train.sampler", "proportional"), "train.gradient", "pcgrad")
    with pytest.raises(ParamsError, match="train.gradient: pcgrad .* needs sampler: joint .* got sampler: proport"):
        parse_params(raw)
    raw["train"]["sampler"] = "joint"
    assert parse_params(raw).train.gradient == "pcgrad"


@pytest.mark.parametrize("value", [True, False, "auto"])
def test_bf16_is_true_false_or_auto(raw_params, value):
    assert parse_params(with_value(raw_params, "train.bf16", value)).train.bf16 == value


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_bf16_names_what_it_accepts(raw_params, value):
    with pytest.raises(ParamsError, match=r"train\.bf16: expected true or false or one of 'auto', got"):
        parse_params(with_value(raw_params, "train.bf16", value))


def test_auto_bf16_follows_the_devices_native_support():
    import torch

    from stages.core.runtime import use_bf16

    cpu = torch.device("cpu")
    assert use_bf16(True, cpu) and not use_bf16(False, cpu)
    assert use_bf16("auto", cpu) == torch.ops.mkldnn._is_mkldnn_bf16_supported()


def test_memory_caps_reach_onednn_and_glibc_before_any_work():
    """In a fresh process (mallopt changes the whole process): the oneDNN capacity is in the environment
    oneDNN reads, glibc accepts the threshold (limit_memory_growth raises if mallopt refuses it), and a
    bf16 training step still runs."""
    import subprocess
    import sys

    script = (
        "import os, torch\n"
        "from stages.core.runtime import limit_memory_growth\n"
        "limit_memory_growth(onednn_cache=8, malloc_threshold_mb=1)\n"
        "assert os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'] == '8'\n"
        "layer = torch.nn.Linear(64, 64)\n"
        "with torch.autocast('cpu', dtype=torch.bfloat16):\n"
        "    layer(torch.randn(4, 64)).sum().backward()\n"
        "print('ok')\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
