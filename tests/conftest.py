"""Shared fixtures: tiny CS224N-format files written per test, and the real packaged tokenizer."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import pickle
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

# No test may reach for the Hugging Face hub; set before transformers is imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist runs one worker per core: one torch thread each, so the workers do not fight over the
    # cores. torch reads it when it starts, so it is set before any test imports torch.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]
# The real default backbone, whose 2-layer slice the tests train; a GPU machine without its package (where
# tests/test_cuda.py runs) names a local copy of it instead.
DEFAULT_BACKBONE = os.environ.get("MTBERT_TEST_BACKBONE", "sentence-transformers/all-MiniLM-L6-v2")
T = TypeVar("T")

# Minimal valid copies of the nine files, in the quirks of the real ones (unnamed index column, the
# SST test header "0<TAB><TAB>id<TAB>sentence", float-string QQP labels, leading spaces in SST text).
RAW_FILES = {
    "ids-sst-train.csv": "\tid\tsentence\tsentiment\n"
                         "0\ts1\t It 's a -LRB- lovely -RRB- film .\t3\n"
                         "1\ts2\t A `` dull '' mess .\t0\n"
                         "2\ts3\t Fine .\t2\n",
    "ids-sst-dev.csv": "\tid\tsentence\tsentiment\n0\tsd1\t Great fun .\t4\n1\tsd2\t Bad .\t1\n",
    "ids-sst-test-student.csv": "0\t\tid\tsentence\n1\t0.0\tst1\t Odd .\n2\t1.0\tst2\t Sweet .\n",
    "quora-train.csv": "\tid\tsentence1\tsentence2\tis_duplicate\n"
                       "10\tq1\tHow do I cook rice?\tWhat is the way to cook rice?\t1.0\n"
                       "11\tq2\t\"\"\"Quoted\"\" words?\"\tWhy is the sky blue?\t0.0\n",
    "quora-dev.csv": "\tid\tsentence1\tsentence2\tis_duplicate\n12\tqd1\tIs it cold?\tIs it warm?\t0.0\n",
    "quora-test-student.csv": "\tid\tsentence1\tsentence2\n13\tqt1\tWho am I?\tWhat am I?\n",
    "sts-train.csv": "\tid\tsentence1\tsentence2\tsimilarity\n"
                     "1\tt1\tA dog runs.\tA dog is running.\t4.6\n"
                     "2\tt2\tA man sings.\tA cat sleeps.\t0.0\n",
    "sts-dev.csv": "\tid\tsentence1\tsentence2\tsimilarity\n3\ttd1\tA boy eats.\tA child eats.\t3.8\n",
    "sts-test-student.csv": "\tid\tsentence1\tsentence2\n4\ttt1\tTwo dogs play.\tDogs are playing.\n",
}


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    """Until `condition()` holds: a test waits for an event (a counter, a status), never for a number of
    seconds, which a busy machine would outrun; fails naming `what` after `timeout`, slack far beyond noise."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        time.sleep(0.02)


def write_raw_files(directory: Path, overrides: dict[str, str | bytes] | None = None) -> Path:
    """The nine raw files (RAW_FILES, with `overrides` replacing some) written into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in {**RAW_FILES, **(overrides or {})}.items():
        path = directory / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
    return directory


def default_tasks() -> dict:
    """The repository's task declarations (SST, QQP, STS) as Task objects, by name."""
    from mtbert.data.tasks import tasks_from_params
    from mtbert.params_file import load_params

    return tasks_from_params(load_params(REPO_ROOT / "params.yaml").tasks)


def __getattr__(name: str):
    """`TASKS` (the default tasks, by name), read on first use: reading them imports torch, which pytest's
    controlling process loads this file without needing (under pytest-xdist it runs no test)."""
    if name != "TASKS":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()["TASKS"] = tasks = default_tasks()
    return tasks


@pytest.fixture
def raw_dir(tmp_path: Path) -> Path:
    return write_raw_files(tmp_path / "raw")


@pytest.fixture(scope="session")
def tokenizer():
    from mtbert.model.backbone import load_tokenizer

    return load_tokenizer(DEFAULT_BACKBONE)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_backbone):
    """The tokenizer of the tests' backbone, on its slice of the real vocabulary (save_tiny_backbone)."""
    from mtbert.model.backbone import load_tokenizer

    return load_tokenizer(str(tiny_backbone))


WORDS = "good bad fine film plot actor dull bright slow quick rice sky blue dog cat runs sleeps sings".split()


def synthetic_raw_files(rows: int) -> dict[str, str]:
    """Deterministic CS224N-format files with `rows` rows per split, for training tests."""
    def sentence(i: int, salt: int) -> str:
        return " ".join(WORDS[(i * 7 + salt * 3 + k * 5) % len(WORDS)] for k in range(3 + (i + salt) % 9))

    files = {}
    for split, suffix in (("train", "train"), ("dev", "dev"), ("test", "test-student")):
        labeled = split != "test"
        sst = ["\tid\tsentence" + ("\tsentiment" if labeled else "")]
        qqp = ["\tid\tsentence1\tsentence2" + ("\tis_duplicate" if labeled else "")]
        sts = ["\tid\tsentence1\tsentence2" + ("\tsimilarity" if labeled else "")]
        for i in range(rows):
            a, b = sentence(i, 1), sentence(i, 2 + i % 3)
            sst.append(f"{i}\t{split}-s{i}\t{a}" + (f"\t{i % 5}" if labeled else ""))
            qqp.append(f"{i}\t{split}-q{i}\t{a}\t{b}" + (f"\t{float(i % 2)}" if labeled else ""))
            sts.append(f"{i}\t{split}-t{i}\t{a}\t{b}" + (f"\t{(i * 0.7) % 5:.1f}" if labeled else ""))
        files[f"ids-sst-{suffix}.csv"] = "\n".join(sst) + "\n"
        files[f"quora-{suffix}.csv"] = "\n".join(qqp) + "\n"
        files[f"sts-{suffix}.csv"] = "\n".join(sts) + "\n"
    return files


def module_folder(request: pytest.FixtureRequest, tmp_path_factory, name: str) -> Path:
    """A new folder for a module-scoped fixture, removed when the module's tests end with none failed.

    The retention policy (pyproject.toml) removes a fixture's folder only when the session ends, so every
    module's repository and models would otherwise be on disk at once (gigabytes in all)."""
    folder = tmp_path_factory.mktemp(name)
    failed_before = request.session.testsfailed

    def remove_unless_a_test_failed() -> None:
        if request.session.testsfailed == failed_before:
            shutil.rmtree(folder, ignore_errors=True)

    request.addfinalizer(remove_unless_a_test_failed)
    return folder


def built_once(tmp_path_factory, name: str, build: Callable[[Path], T]) -> T:
    """`build(folder)`'s result, built by one process of the session: under pytest-xdist the first worker to
    ask builds it in a folder every worker sees while the others wait, then each reads its pickled result.
    The builds are deterministic, so which worker builds changes nothing; only the work done twice goes."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return build(tmp_path_factory.mktemp(name))
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent  # this session's, above every worker's own folder
    folder, result = shared / name, shared / f"{name}.pickle"
    with FileLock(str(shared / f"{name}.lock")):
        if not result.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a build that failed left
            folder.mkdir()
            built = build(folder)
            result.write_bytes(pickle.dumps(built))
            return built
    return pickle.loads(result.read_bytes())


@pytest.fixture(scope="session")
def tiny_backbone(tmp_path_factory) -> Path:
    """A 2-layer slice of the real default backbone, on a slice of its vocabulary, saved like any local model."""
    return built_once(tmp_path_factory, "backbone", save_tiny_backbone)


# The tokens the tests' backbone keeps: the vocabulary's first ids (the special tokens and the most frequent
# words) and every single character, with and without "##", so that any text still splits into pieces. The
# whole vocabulary's 30,522 embeddings would be three quarters of the 2-layer slice's weights, copied by
# every model saved, checkpoint, exported graph and DVC cache in the suite.
KEPT_IDS = 4096


def save_tiny_backbone(path: Path) -> Path:
    import torch

    from mtbert.model.backbone import PROVENANCE_FILE, load_encoder, load_tokenizer

    encoder = load_encoder(DEFAULT_BACKBONE)
    encoder.encoder.layer = encoder.encoder.layer[:2]
    encoder.config.num_hidden_layers = 2
    load_tokenizer(DEFAULT_BACKBONE).save_pretrained(path)
    kept = slice_vocabulary(path, KEPT_IDS)
    rows = encoder.get_input_embeddings().weight.detach()[torch.tensor(kept)].clone()
    encoder.resize_token_embeddings(len(kept))
    encoder.get_input_embeddings().weight.data.copy_(rows)
    encoder.save_pretrained(path)
    # As the `pretrain` stage leaves it (disabled), so `train --pretrained-dir` accepts the folder.
    (path / PROVENANCE_FILE).write_text(json.dumps({"backbone": str(path), "pretrained": False}))
    return path


def slice_vocabulary(folder: Path, first: int) -> list[int]:
    """Rewrite the WordPiece tokenizer saved in `folder` to keep ids below `first` (unchanged) and then every
    single-character token; the old ids of the tokens kept, in their new order (the embedding rows to keep)."""
    state = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    vocabulary = state["model"]["vocab"]
    tokens = sorted(vocabulary, key=vocabulary.__getitem__)
    kept = tokens[:first] + [token for token in tokens[first:] if len(token.removeprefix("##")) == 1]
    state["model"]["vocab"] = {token: new_id for new_id, token in enumerate(kept)}
    (folder / "tokenizer.json").write_text(json.dumps(state, ensure_ascii=False), encoding="utf-8")
    (folder / "vocab.txt").write_text("".join(f"{token}\n" for token in kept), encoding="utf-8")
    return [vocabulary[token] for token in kept]


# all-mpnet-base-v2's config and tokenizer files (the weights are 440 MB: `make mpnet`); the tests build a 2-layer
# MPNet of that config with seeded random weights, which exercises every difference of the family but quality.
MPNET_FILES = REPO_ROOT / "tests" / "fixtures" / "mpnet"


@pytest.fixture(scope="session")
def tiny_mpnet(tmp_path_factory) -> Path:
    """A 2-layer MPNet of all-mpnet-base-v2's config at MiniLM's width, saved like any local model."""
    return built_once(tmp_path_factory, "mpnet", save_tiny_mpnet)


def save_tiny_mpnet(path: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoTokenizer, MPNetModel

    from mtbert.model.backbone import PROVENANCE_FILE

    config = AutoConfig.from_pretrained(MPNET_FILES)
    # 2 layers, 384 wide (MiniLM's 12 heads of 32): what differs between the families (the vocabulary, pad
    # id, positions, the shared relative-position bias, no token types) is all there, at the cost of the
    # BERT slice's
    config.update({"num_hidden_layers": 2, "hidden_size": 384, "intermediate_size": 1536})
    with torch.random.fork_rng():
        torch.manual_seed(0)
        MPNetModel(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(MPNET_FILES).save_pretrained(path)
    (path / PROVENANCE_FILE).write_text(json.dumps({"backbone": str(path), "pretrained": False}))
    return path


@pytest.fixture(scope="session", params=["bert", "mpnet"])
def family_backbone(request) -> Path:
    """A 2-layer slice of each encoder family: the default's (BERT) and MPNet's."""
    return request.getfixturevalue("tiny_backbone" if request.param == "bert" else "tiny_mpnet")


@pytest.fixture(scope="session")
def dropout_free_backbone(tmp_path_factory, tiny_backbone) -> Path:
    """The 2-layer backbone with dropout off, so two code paths (1 and 2 processes, bf16 and fp32, gloo and
    NCCL) compute the same network."""
    from mtbert.model.backbone import PROVENANCE_FILE

    path = tmp_path_factory.mktemp("nodropout")
    shutil.copytree(tiny_backbone, path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (path / "config.json").write_text(json.dumps(config))
    (path / PROVENANCE_FILE).write_text(json.dumps({"backbone": str(path), "pretrained": False}))
    return path


def make_params(tmp_path: Path, backbone: Path, raw_dir: Path, *, model=None, train=None, heads=None, smart=None,
                models=None, runtime=None, extra=None) -> Path:
    """A params.yaml for tests: the repository's, pointed at the test data and the small backbone."""
    import yaml

    from mtbert.variants import deep_merge

    # libyaml's parser (the same safe schema as yaml.safe_load, a fraction of its time): tests call this often
    params = yaml.load((REPO_ROOT / "params.yaml").read_text(), Loader=yaml.CSafeLoader)
    params["data"]["raw_dir"] = str(raw_dir)
    # The plain configuration the tests' expectations are written for (shared encoder, CLS pooling, fp32,
    # cross-encoded pairs, the raw weights, a uniform ensemble, no student); a test that wants another
    # architecture, pooling, encoding, bf16, the weights' moving average, greedy or a student asks for it.
    params["model"].update(arch="shared")
    params["train"].update(bf16=False, ema=0.0)
    params["ensemble"].update(method="uniform")  # every member, so what is averaged is known in advance
    params["distill"].update(enabled=False)  # tests of the student turn it on
    for task in params["tasks"]:
        params["heads"].setdefault(task, {})["pooling"] = "cls"
    params["heads"]["sts"]["encoding"] = "cross"
    params["model"].update(model or {}, name=str(backbone))
    params["tokenize"]["max_length"] = 32
    params["train"].update(epochs=2, batch_size=4, eval_batch_size=8, bucket_batches=2)  # every task's, a test's too
    params["runtime"] = deep_merge(params["runtime"], {"threads": 1, "checkpoint_every": {"train": 3}})
    params["runtime"] = deep_merge(params["runtime"], runtime or {})
    params["train"] = deep_merge(params["train"], train or {})
    params["heads"] = deep_merge(params["heads"], heads or {})
    params["smart"] = deep_merge(params["smart"], smart or {})
    params["models"] = models or {"base": {}}
    if params["distill"]["variant"] not in params["models"]:  # it must name a variant, on or off
        params["distill"]["variant"] = next(iter(params["models"]))
    params = deep_merge(params, extra or {})  # e.g. a task declared in the test alone
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))  # keep the tasks in their declared order
    return path


@pytest.fixture(scope="session")
def tiny_tokenized(tmp_path_factory, tiny_backbone) -> Path:
    """Tokenized synthetic data (16 rows per split) for training tests."""
    return built_once(tmp_path_factory, "tokenized", lambda root: tokenize_synthetic(root, tiny_backbone))


def tokenize_synthetic(root: Path, tiny_backbone: Path) -> Path:
    from typer.testing import CliRunner

    from stages.tokenize import app

    raw = write_raw_files(root / "raw", synthetic_raw_files(16))
    params = make_params(root, tiny_backbone, raw)
    result = CliRunner().invoke(app, ["--params-file", str(params), "--out-dir", str(root / "tok"),
                                      "--rejects-file", str(root / "rejects.tsv"),
                                      "--metrics-file", str(root / "data.json")])
    assert result.exit_code == 0, result.output
    return root / "tok"


def saved_heads(model_dir: Path) -> dict[str, list]:
    """Every head weight of a trained variant's folder, by `epoch-<E>/<name>`, as lists (comparable with ==)."""
    from safetensors.torch import load_file

    return {f"{folder.name}/{name}": tensor.tolist() for folder in sorted(Path(model_dir).glob("epoch-*"))
            for name, tensor in load_file(str(folder / "heads.safetensors")).items()}


@contextlib.contextmanager
def recorded_forwards(record: Callable) -> Iterator[set]:
    """What `record(module, output)` returns for every module that runs forward in the block (None: nothing)."""
    import torch

    seen: set = set()

    def hook(module, inputs, output):
        item = record(module, output)
        if item is not None:
            seen.add(item)

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def attention_runs():
    """(training, attention implementation) of every BERT self-attention module that runs in the block."""
    return recorded_forwards(lambda module, output: (module.training, module.config._attn_implementation)
                             if type(module).__name__ == "BertSelfAttention" else None)


def kill_once_checkpointed(command: list[str], checkpoint: Path, timeout: float = 180) -> None:
    """Start `command`, and SIGKILL it and every process it started once `checkpoint` appears."""
    import signal
    import subprocess
    import time

    # its own session, so a launcher (torchrun) and its workers die together, as under a kill of the job
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    deadline = time.time() + timeout
    while not checkpoint.exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, "the run finished before it could be killed"
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert checkpoint.exists()


# The longest test files first (by `pytest --durations`): pytest-xdist hands out whole files in collection
# order (with --no-loadscope-reorder; by default it orders them by their number of tests), so a long file
# handed out last would leave the other worker idle at the end. test_deploy.py goes early and builds the
# shared `deployed` fixture (the suite's longest setup); the files that need no export follow, so that the
# other worker works rather than waits while it is built; the other files that use it, or `ensemble_export`
# (built from it), go last.
LONGEST_FIRST = ("test_pipeline.py", "test_faults.py", "test_distributed.py", "test_train.py", "test_deploy.py",
                 "test_families.py", "test_arch.py", "test_pretrain.py", "test_errors.py")
USE_DEPLOYED = ("test_ensemble_export.py", "test_serve_hostile.py", "test_serve.py", "test_fuzz.py", "test_bench.py")


def pytest_collection_modifyitems(items):
    def rank(item) -> tuple[int, int]:
        name = item.path.name
        if name in USE_DEPLOYED:
            return 2, USE_DEPLOYED.index(name)
        return (0, LONGEST_FIRST.index(name)) if name in LONGEST_FIRST else (1, 0)

    items.sort(key=rank)  # stable: each file's tests keep their order


def pytest_collection_finish(session):
    """Everything the collection imported (torch, transformers, ONNX, the server) moved out of the garbage
    collector's sight. Each full collection then looks only at what the tests made since: the stages free
    their cycles with gc.collect() at every epoch's end and between an export's phases (mtbert/runtime.py),
    and a collection over all the imports is slow (docs/performance.md, the test suite)."""
    gc.freeze()


@pytest.fixture(scope="session")
def trained(tmp_path_factory, tiny_backbone, tiny_tokenized):
    """Two small variants with their dumps and the ensemble over them, not exported (tests/deployed.py)."""
    from tests.deployed import build_trained

    return built_once(tmp_path_factory, "trained", lambda root: build_trained(root, tiny_backbone, tiny_tokenized))


@pytest.fixture(scope="session")
def deployed(tmp_path_factory, trained):
    """`trained` with each variant's own export (the `export` stage's)."""
    from tests.deployed import export_each

    return built_once(tmp_path_factory, "deployed", lambda root: export_each(trained, root))


@pytest.fixture(scope="session")
def ensemble_export(tmp_path_factory, deployed) -> tuple[Path, dict]:
    """exports/ensemble over `trained` as the `export_ensemble` stage writes it, and its metrics; its members'
    exports are `deployed`'s (tests/deployed.py, export_ensemble)."""
    from tests.deployed import export_ensemble

    return built_once(tmp_path_factory, "ensemble-export", lambda root: export_ensemble(deployed, root,
                                                                                         members_from=deployed))
