import copy

import pytest
import yaml

from mtbert.params import ParamsError
from mtbert.params_file import load_params, parse_params, variant_params
from tests.conftest import REPO_ROOT


@pytest.fixture
def raw_params() -> dict:
    return yaml.safe_load((REPO_ROOT / "params.yaml").read_text())


def test_repository_params_file_is_valid():
    params = load_params(REPO_ROOT / "params.yaml")
    assert params.model.name == "sentence-transformers/all-MiniLM-L6-v2"  # the packaged backbone: no hub here
    names = ["sst", "qqp", "sts"]
    assert list(params.tasks) == list(params.heads) == names
    assert list(params.train.batch_size) == list(params.smart.task_lambda) == names
    assert params.heads["sts"].target == "raw" and params.heads["sst"].encoding is None


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
    ("tokenize.max_length", "128", "tokenize.max_length: expected a valid integer, got '128'"),
    ("tokenize.max_length", 4, "tokenize.max_length: expected greater than or equal to 8, got 4"),
    ("tokenize.batch_size", True, "tokenize.batch_size: expected a valid integer, got True"),
    ("data.max_reject_fraction", 1.5, "data.max_reject_fraction: expected less than or equal to 1, got 1.5"),
    ("data.max_reject_fraction", float("nan"), "data.max_reject_fraction: expected a finite number"),
    ("data.unescape_ptb", ["sst", "mnli"], "data.unescape_ptb: unknown task 'mnli'; tasks declares sst, qqp, sts"),
    ("data.unescape_ptb", "sst", "data.unescape_ptb: expected a valid list, got 'sst'"),
    ("model.name", "", "model.name: string should have at least 1 character, got ''"),
    ("smart.lambda", -1, "smart.lambda: expected greater than or equal to 0, got -1"),
    ("smart.task_lambda.sst", "high", "smart.task_lambda.sst: expected a valid number, got 'high'"),
    ("smart.task_lambda.qqp", -1, "smart.task_lambda.qqp: expected greater than or equal to 0, got -1"),
    ("smart.task_lambda", "high", "smart.task_lambda: expected a valid number, got 'high'"),
    ("train.batch_size", {"sts": 0}, "train.batch_size.sts: expected greater than or equal to 1, got 0"),
    ("train.batch_size", {"sst": 3.5}, "train.batch_size.sst: expected a valid integer, got 3.5"),
    ("train.batch_size", 0, "train.batch_size: expected greater than or equal to 1, got 0"),  # one value: no task
    ("train.batch_size", True, "train.batch_size: expected a valid integer, got True"),
    ("train.task_lr_mult", {"qqp": 0}, "train.task_lr_mult.qqp: expected greater than 0, got 0"),
    ("train.max_train_examples", [5], "train.max_train_examples: expected a valid integer, got [5]"),
    ("train.lr", -1, "train.lr: expected greater than 0, got -1"),
    ("train.lr", float("inf"), "train.lr: expected a finite number, got inf"),
    ("runtime.threads", -1, "runtime.threads: expected greater than or equal to 0, got -1"),
    ("runtime.checkpoint_every.train", 0, "runtime.checkpoint_every.train: expected greater than or equal to 1, got 0"),
    ("smart.norm", "l1", "smart.norm: expected 'inf' or 'l2', got 'l1'"),
    ("smart.beta", 1.0, "smart.beta: expected less than 1, got 1.0"),
    ("model", "bert", "model: expected a mapping, got 'bert'"),
    ("pretrain.enabled", 1, "pretrain.enabled: expected a valid boolean, got 1"),
    ("tasks.sst.label", 3, "tasks.sst.label: expected a valid string, got 3"),
])
def test_bad_values_name_the_key_and_what_was_expected(raw_params, key, value, message):
    with pytest.raises(ParamsError, match=f"^params: {message}".replace("[", r"\[").replace("]", r"\]")) as error:
        parse_params(with_value(raw_params, key, value))
    assert "\n" not in str(error.value)  # one line, never pydantic's report


def test_ints_are_floats_and_stored_as_floats(raw_params):
    params = parse_params(with_value(with_value(raw_params, "train.lr", 1), "train.task_lr_mult", {"qqp": 2}))
    assert params.train.lr == 1.0 and isinstance(params.train.lr, float)
    assert params.train.task_lr_mult == {"sst": 1.0, "qqp": 2.0, "sts": 1.0}
    assert all(isinstance(value, float) for value in params.train.task_lr_mult.values())
    assert params.tasks["sts"].range == [0.0, 5.0] and isinstance(params.tasks["sts"].range[0], float)


def test_a_per_task_knob_takes_a_scalar_for_every_task(raw_params):
    from mtbert.params import as_dict

    raw = with_value(with_value(raw_params, "train.batch_size", 16), "smart.task_lambda", 0.5)
    params = parse_params(raw)
    assert params.train.batch_size == {"sst": 16, "qqp": 16, "sts": 16}
    assert [params.smart.task_weight(task) for task in params.tasks] == [0.5, 0.5, 0.5]
    assert as_dict(params)["train"]["batch_size"] == {"sst": 16, "qqp": 16, "sts": 16}  # saved in full
    assert parse_params(with_value(raw, "smart.task_lambda", None)).smart.task_lambda == dict.fromkeys(params.tasks)


def test_a_per_task_map_overrides_some_tasks_and_the_rest_get_the_default(raw_params):
    raw = with_value(raw_params, "train.batch_size", {"qqp": 64})
    raw["train"]["task_lr_mult"] = {"sts": 2}
    raw["train"]["max_train_examples"] = {"sst": 100}
    raw["smart"].update({"lambda": 3.0, "task_lambda": {"qqp": 0.0}})
    params = parse_params(raw)
    assert list(params.train.batch_size) == list(params.tasks)  # task order, whatever the map's
    assert params.train.batch_size == {"sst": 32, "qqp": 64, "sts": 32}
    assert params.train.task_lr_mult == {"sst": 1.0, "qqp": 1.0, "sts": 2.0}
    assert params.train.max_train_examples == {"sst": 100, "qqp": 0, "sts": 0}
    assert params.smart.task_lambda == {"sst": None, "qqp": 0.0, "sts": None}
    assert [params.smart.task_weight(task) for task in params.tasks] == [3.0, 0.0, 3.0]
    variant = {"base": {}, "big": {"train": {"batch_size": {"sts": 8}}}}  # a variant's map merges task by task
    raw["models"] = variant
    assert variant_params(raw, "big").train.batch_size == {"sst": 32, "qqp": 64, "sts": 8}


def test_a_variants_map_over_a_shared_scalar_keeps_the_scalar_for_the_tasks_it_does_not_name(raw_params):
    raw = with_value(raw_params, "train.batch_size", 16)
    raw["models"] = {"base": {}, "big": {"train": {"batch_size": {"qqp": 64}}, "smart": {"task_lambda": {"sst": 2.0}}}}
    big = variant_params(raw, "big")
    assert big.train.batch_size == {"sst": 16, "qqp": 64, "sts": 16}
    assert big.smart.task_lambda == {"sst": 2.0, "qqp": 0.0, "sts": 0.0}
    assert variant_params(raw, "base").train.batch_size == {"sst": 16, "qqp": 16, "sts": 16}


def test_a_per_task_map_naming_an_undeclared_task_is_refused(raw_params):
    with pytest.raises(ParamsError, match=r"^params: train.batch_size.mnli: unknown task; tasks declares sst, qqp"):
        parse_params(with_value(raw_params, "train.batch_size", {"sst": 8, "mnli": 8}))
    raw_params["models"] = {"base": {}, "typo": {"smart": {"task_lambda": {"stsb": 1.0}}}}
    with pytest.raises(ParamsError, match=r"^params: models.typo.smart.task_lambda.stsb: unknown task"):
        parse_params(raw_params)


@pytest.mark.parametrize(("override", "message"), [
    ({"train": {"batch_size": 0}}, "models.big.train.batch_size: expected greater than or equal to 1, got 0"),
    ({"train": {"batch_size": {"qqp": 0}}}, "models.big.train.batch_size.qqp: expected greater than or equal to 1"),
    ({"heads": {"sst": {"dropout": 2.0}}}, "models.big.heads.sst.dropout: expected less than 1, got 2.0"),
])
def test_a_variants_per_task_error_names_the_key_as_the_variant_wrote_it(raw_params, override, message):
    raw_params["models"] = {"base": {}, "big": override}
    with pytest.raises(ParamsError, match=f"^params: {message}"):
        parse_params(raw_params)


def test_errors_inside_mappings_keep_their_whole_key(raw_params):
    with pytest.raises(ParamsError, match=r"^params: tasks.sst.label: expected a valid string, got 3$"):
        parse_params(with_value(raw_params, "tasks.sst.label", 3))
    with pytest.raises(ParamsError, match=r"^params: heads.qqp.pooling: expected 'cls', 'mean'"):
        parse_params(with_value(raw_params, "heads", {"qqp": {"pooling": "first"}}))


def test_a_changed_per_task_knob_names_its_task(raw_params):
    from mtbert.params_file import with_changes

    train = parse_params(raw_params).train
    with pytest.raises(ParamsError, match=r"^batch_size.sts: expected greater than or equal to 1, got 0$"):
        with_changes(train, batch_size={**train.batch_size, "sts": 0})


def test_a_task_left_out_of_heads_gets_every_default(raw_params):
    from mtbert.params import HeadParams

    params = parse_params(raw_params)
    assert "sst" not in raw_params["heads"] and "qqp" not in raw_params["heads"]
    assert params.heads["sst"] == HeadParams(pooling="mean", hidden_layers=1, dropout=0.0, loss_weight=1.0,
                                             encoding=None, combine=None, target=None)
    assert params.heads["qqp"] == HeadParams(encoding="cross", combine="features")
    assert params.heads["sts"] == HeadParams(encoding="bi", combine="cosine", target="raw")


def test_the_resolved_params_of_the_repository_are_todays():
    """as_dict is hashed into resume fingerprints and saved beside models: the simplified params.yaml must
    give exactly the nested dict that the fully spelled-out one gave."""
    from mtbert.params import as_dict

    params = as_dict(load_params(REPO_ROOT / "params.yaml"))
    assert params["heads"] == {
        "sst": {"pooling": "mean", "hidden_layers": 1, "dropout": 0.0, "loss_weight": 1.0, "encoding": None,
                "combine": None, "target": None},
        "qqp": {"pooling": "mean", "hidden_layers": 1, "dropout": 0.0, "loss_weight": 1.0, "encoding": "cross",
                "combine": "features", "target": None},
        "sts": {"pooling": "mean", "hidden_layers": 1, "dropout": 0.0, "loss_weight": 1.0, "encoding": "bi",
                "combine": "cosine", "target": "raw"}}
    assert {key: params["train"][key] for key in ("task_lr_mult", "batch_size", "max_train_examples")} == {
        "task_lr_mult": {"sst": 1.0, "qqp": 1.0, "sts": 1.0}, "batch_size": {"sst": 32, "qqp": 32, "sts": 32},
        "max_train_examples": {"sst": 0, "qqp": 0, "sts": 0}}
    assert params["smart"]["task_lambda"] == {"sst": None, "qqp": 0.0, "sts": 0.0}
    assert list(params) == ["tasks", "data", "tokenize", "model", "pretrain", "heads", "train", "smart", "predict",
                            "ensemble", "stats", "runtime", "models"]


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


@pytest.mark.parametrize(("text", "where", "problem"), [
    ("train:\n  lr: 1\n   epochs: 2\n", "line 3, column 10", "mapping values are not allowed here"),  # under a scalar
    ("train:\n  lr: [1, 2\nsmart: {}\n", "line 3, column 6", "expected ',' or ']', but got ':'"),  # an unclosed list
    ("train:\n\tlr: 1\n", "line 2, column 1", "found character '\\t' that cannot start any token"),  # a tab
])
def test_a_yaml_syntax_error_is_one_line_naming_the_file_line_and_column(tmp_path, text, where, problem):
    """The C parser reads the file; a refusal is worded by the pure-Python one, which says what it found."""
    path = tmp_path / "params.yaml"
    path.write_text(text)
    for load in (load_params, lambda p: variant_params(p, "base")):
        with pytest.raises(ParamsError, match=f"^{path}: not valid YAML at {where}: ") as error:
            load(path)
        assert "\n" not in str(error.value) and str(error.value).endswith(f": {problem}")


def test_params_yaml_is_read_by_ruamels_c_parser():
    """ruamel.yaml.clib installed (pyproject.toml) and used: every stage and test reads params.yaml."""
    from ruamel.yaml import YAML
    from ruamel.yaml.clib._ruamel_yaml import CParser

    assert YAML(typ="safe").Parser is CParser


def test_numbers_as_dvc_writes_them_are_numbers_and_a_key_given_twice_is_refused(tmp_path):
    """params.yaml is read as DVC reads it (YAML 1.2): `dvc exp run -S train.lr=5e-5` writes `lr: 5e-05`,
    which YAML 1.1 reads as a string. A key given twice names its line rather than keeping one of the two."""
    from dvc.utils.hydra import apply_overrides

    path = tmp_path / "params.yaml"
    path.write_bytes((REPO_ROOT / "params.yaml").read_bytes())
    apply_overrides(path, ["train.lr=5e-5", "+models.slow={train: {lr: 2e-5}}"])
    assert "lr: 5e-05" in path.read_text()  # DVC's own writing, which YAML 1.1 types as a string
    assert load_params(path).train.lr == 5e-5 and variant_params(path, "slow").train.lr == 2e-5
    path.write_text("train:\n  lr: 1.0e-4\n  lr: 2.0e-4\n")
    with pytest.raises(ParamsError, match=f"^{path}: not valid YAML at line 3, column 3: found duplicate key"):
        load_params(path)


def test_variant_overrides_deep_merge_over_the_shared_sections(raw_params):
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
    raw_params["models"] = {"base": {}, "bad name": {}}
    with pytest.raises(ParamsError, match=r"models.bad name: a variant name may use"):
        parse_params(raw_params)


def test_smart_lambda_is_keyed_as_in_params_yaml(raw_params):
    from mtbert.params import as_dict

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
    with pytest.raises(ParamsError, match=r"train\.bf16: expected true, false or 'auto', got"):
        parse_params(with_value(raw_params, "train.bf16", value))


def test_auto_bf16_follows_the_devices_native_support():
    import torch

    from mtbert.runtime import use_bf16

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
        "from mtbert.runtime import limit_memory_growth\n"
        "limit_memory_growth(onednn_cache=8, malloc_threshold_mb=1)\n"
        "assert os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'] == '8'\n"
        "layer = torch.nn.Linear(64, 64)\n"
        "with torch.autocast('cpu', dtype=torch.bfloat16):\n"
        "    layer(torch.randn(4, 64)).sum().backward()\n"
        "print('ok')\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_an_export_keeps_blocks_of_twice_its_largest_weights_file_on_the_heap(tmp_path):
    """The export stages' mmap threshold: twice the largest weights file of the models they export (a graph is
    about one encoder's weights), in whole MiB, or runtime.malloc_threshold_mb where that is larger."""
    from mtbert.runtime import graph_heap_mb

    for folder, sizes in {"a/epoch-1/encoder": [3 * 2**20 + 1], "a/epoch-2/encoder": [2**20], "b": [5 * 2**20]}.items():
        (tmp_path / folder).mkdir(parents=True)
        for i, size in enumerate(sizes):
            (tmp_path / folder / f"model{i}.safetensors").write_bytes(b"\0" * size)
    (tmp_path / "b" / "tokenizer.json").write_bytes(b"\0" * 9 * 2**20)  # not weights
    assert graph_heap_mb([tmp_path / "a"], 0) == 7  # 2 x (3 MiB + 1 byte), rounded up
    assert graph_heap_mb([tmp_path / "a", tmp_path / "b"], 0) == 10
    assert graph_heap_mb([tmp_path / "a"], 16) == 16
    assert graph_heap_mb([tmp_path / "missing"], 16) == 16


@pytest.mark.parametrize("override", [{"heads": None}, {"heads": {"sts": None}}])
def test_a_variants_null_over_a_shared_mapping_is_refused(raw_params, override):
    raw_params["models"] = {"base": {}, "reset": override}
    with pytest.raises(ParamsError, match=r"models\.reset\.heads(\.sts)?: expected a mapping of overrides, got null"):
        variant_params(raw_params, "reset")


@pytest.mark.parametrize(("threads", "expected"), [(0, None), (3, 3)])
def test_runtime_threads_zero_is_every_core_and_a_number_is_kept(raw_params, threads, expected):
    import os

    raw_params["runtime"]["threads"] = threads
    assert parse_params(raw_params).runtime.threads == (expected or len(os.sched_getaffinity(0)))
