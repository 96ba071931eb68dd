"""Every stage killed (SIGKILL, its whole process group) at a random moment of its work, then `dvc repro`:
the pipeline ends on the uninterrupted run's outputs, to their hashes in dvc.lock.

A tiny pipeline (2-layer backbone, 16 rows per split, two members, masked-LM pretraining, a distilled
student and both exports) runs once uninterrupted; that run's dvc.lock is the reference, and the time
each stage took sets the range its kill moments are drawn from. Then, per stage kind (KINDS, each one),
`dvc repro -f -s <stage>` is killed a moment after the stage's own command starts, if that command still
works then (a moment past its end is tried again earlier), and the test asserts that a kill landed while it
worked; then the stage is run again (`-f`: a plain `dvc repro` would check the
reference's outputs out of DVC's cache, and the stage's own atomic writes and resumption would go
unexercised). That run starts from whatever the kill left (a checkpoint, a half-written folder or file,
which the run must remove), and after it and a plain `dvc repro` (which runs again only what reads a
timing measured anew) every output must be as the reference has it.

The outputs that record time (each metrics file's `speed`, an export's `reason`, which quotes its
measured speed-up) are compared without those keys; every other output to its hash. Training is fp32
here, where a resumed run matches an uninterrupted one to the bit.

MTBERT_KILLS (default 1) kills per stage; MTBERT_KILL_SEED (default 0) draws the moments. `make kills`
runs many and prints what each kill hit.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import yaml

from tests.conftest import make_params, module_folder, synthetic_raw_files
from tests.repos import dvc, dvc_env, pipeline_repo

pytestmark = pytest.mark.slow(reason="a real `dvc repro` of the pipeline, then each stage killed and repeated")

KILLS = int(os.environ.get("MTBERT_KILLS", "1"))
SEED = int(os.environ.get("MTBERT_KILL_SEED", "0"))
TRIES = 4  # kills per planned kill, until one lands while the stage's command works
# every stage kind of the tiny pipeline below (dvc.yaml's stages, distillation on), each killed mid-work
KINDS = {"tokenize", "pretrain", "transfer", "train", "predict", "ensemble", "export", "export_ensemble", "distill",
         "stats"}
TIMING_KEYS = ("speed", "reason")  # what a re-run measures anew (see the module's docstring)


def write_params(backbone: Path):
    def write(repo: Path) -> None:
        make_params(repo, backbone, Path("data/raw"), train={"epochs": 1},
                    runtime={"checkpoint_every": {"train": 3, "pretrain": 2}},
                    # int8 off: where it is on, the engine is chosen by a timing, which could differ between runs
                    extra={"predict": {"batch_size": 8, "bf16": False},
                           "export": {"models": ["distilled"], "int8": False},
                           "pretrain": {"enabled": True, "steps": 6, "batch_size": 8, "eval_every": 3,
                                        "eval_examples": 16, "max_length": 32},
                           "distill": {"enabled": True, "variant": "plain", "students": {"distilled": 0}}},
                    models={"plain": {}, "plain-seed1": {"train": {"seed": 1}}})
    return write


def timed_repro(repo: Path) -> dict[str, float]:
    """`dvc repro`, uninterrupted: the seconds each stage ran, by stage, in the order they ran."""
    process = subprocess.Popen(["dvc", "repro"], cwd=repo, env=dvc_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    starts, output = {}, []
    for line in process.stdout:
        output.append(line)
        if line.startswith("Running stage '"):
            starts[line.split("'")[1]] = time.monotonic()
    assert process.wait() == 0, "".join(output)
    ends = [*list(starts.values())[1:], time.monotonic()]
    return {stage: end - start for (stage, start), end in zip(starts.items(), ends, strict=True)}


@pytest.fixture(scope="module")
def reference(request, tmp_path_factory, tiny_backbone) -> tuple[Path, dict[str, float], dict]:
    """The repository after an uninterrupted run, each stage's seconds, and what that run's outputs hold."""
    folder = module_folder(request, tmp_path_factory, "kills")
    repo = pipeline_repo(folder, synthetic_raw_files(16), write_params(tiny_backbone))
    seconds = timed_repro(repo)
    return repo, seconds, outputs(repo)


def outputs(repo: Path) -> dict[str, object]:
    """Every output in dvc.lock: its hash, or for a JSON file, what it holds less TIMING_KEYS."""
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    return {out["path"]: comparable(repo / out["path"], out["md5"])
            for stage in lock.values() for out in stage.get("outs", [])}


def comparable(path: Path, md5: str):
    return without_timings(json.loads(path.read_text())) if path.suffix == ".json" else md5


def without_timings(held):
    """`held` less TIMING_KEYS, at any depth (an ensemble's export gives each member's engine a reason)."""
    if isinstance(held, dict):
        return {key: without_timings(value) for key, value in held.items() if key not in TIMING_KEYS}
    return [without_timings(value) for value in held] if isinstance(held, list) else held


def temporaries(repo: Path) -> list[str]:
    """The temporaries of atomic writes (`.<name>.<pid>.<random>`, mtbert/io.py) in the repository's
    folders: a killed write leaves one, and the next write of that output must remove it."""
    return sorted(str(path.relative_to(repo)) for folder in ("data", "models", "metrics", "exports", "checkpoints")
                  for path in (repo / folder).rglob(".*") if re.fullmatch(r"\..+\.\d+\..+", path.name))


def command_of(dvc_process: psutil.Process, kind: str) -> psutil.Process | None:
    """The stage's own command (`python -m stages.<kind>`, dvc.yaml) among what `dvc` started, or None."""
    for child in dvc_process.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if f"stages.{kind}" in child.cmdline():
                return child
    return None


def running(process: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return process.status() != psutil.STATUS_ZOMBIE
    return False


def kill_at(repo: Path, stage: str, moment: float) -> str:
    """`dvc repro -f -s stage`, SIGKILLed with every process it started `moment` s after the stage's command
    began, if that command still works then: "mid-work". Otherwise nothing is killed and the run ends:
    "after the command" when DVC alone was still at work, "finished" when all had ended.

    The whole group is stopped (SIGSTOP) before the command is looked at, so that the answer cannot change
    before the kill. DVC is never killed after the command: it writes dvc.lock in place (`open(path, "w+")`,
    dvc/utils/serialize/_common.py), and a kill during that write leaves a dvc.lock it cannot read, a limit of
    DVC's that no stage can repair (docs/training.md says what to do)."""
    process = subprocess.Popen(["dvc", "repro", "-f", "-s", stage], cwd=repo, env=dvc_env(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    command, deadline = None, time.monotonic() + 300
    while command is None and process.poll() is None and time.monotonic() < deadline:
        command = command_of(psutil.Process(process.pid), stage.split("@")[0])
        time.sleep(0.01)
    time.sleep(moment)
    if process.poll() is not None:
        return "finished"
    os.killpg(process.pid, signal.SIGSTOP)
    if command is not None and running(command):
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return "mid-work"
    os.killpg(process.pid, signal.SIGCONT)
    assert process.wait() == 0, f"{stage}: `dvc repro -f -s {stage}` failed after it was stopped and resumed"
    return "after the command"


def killed_stages(seconds: dict[str, float]) -> list[str]:
    """One stage of each kind (the first of each foreach group), in the order they run."""
    kinds = {}
    for stage in seconds:
        kinds.setdefault(stage.split("@")[0], stage)
    return list(kinds.values())


def test_every_stage_killed_mid_work_is_rebuilt_by_repro_to_the_uninterrupted_outputs(reference):
    """Each kind is killed KILLS times while its command works; a kill that lands after the command ended
    (its moment drawn past the command's end) is followed by one at half the moment, up to TRIES in all."""
    repo, seconds, expected = reference
    assert set(kind.split("@")[0] for kind in killed_stages(seconds)) == KINDS
    draw = random.Random(SEED)
    hits = []
    for stage in killed_stages(seconds):
        for _ in range(KILLS):
            moment = draw.uniform(0, seconds[stage])
            for _ in range(TRIES):
                outcome = kill_at(repo, stage, moment)
                left = temporaries(repo)
                dvc(repo, "repro", "-f", "-s", stage)
                dvc(repo, "repro")  # what reads a timing measured anew runs again: `stats` reads each training's
                hits.append((stage, round(moment, 2), outcome, left))
                assert outputs(repo) == expected, f"{stage}, killed at {moment:.2f} s ({outcome}), then run again"
                assert not temporaries(repo), f"{stage}, killed at {moment:.2f} s ({outcome}), left {temporaries(repo)}"
                if outcome == "mid-work":
                    break
                moment /= 2
    print("\n".join(f"{stage}: {outcome} at {moment} s, leaving {left or 'no temporary'}"
                    for stage, moment, outcome, left in hits))
    landed = collections.Counter(stage for stage, _, outcome, _ in hits if outcome == "mid-work")
    assert landed == {stage: KILLS for stage in killed_stages(seconds)}, hits
