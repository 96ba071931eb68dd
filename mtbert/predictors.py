"""Which engine runs a folder, for `mtbert predict` and `mtbert serve`: an export (`mtbert export`, with its
manifest.json) runs on ONNX Runtime, a trained variant's folder on PyTorch.

`--engine auto` takes ONNX Runtime where every folder asked for (the model, or each of the ensemble's
members) is an export, with the export's default graphs (fp32 `onnx`, or `int8` where the export found it
as good and faster); PyTorch otherwise. `onnx` and `int8` ask for those graphs, `torch` for PyTorch. The
PyTorch modules are imported only when PyTorch is the engine, so an export's command starts fast.
"""

from __future__ import annotations

from pathlib import Path

from mtbert.deploy.engine import OnnxEnsemblePredictor, is_export, load_export
from mtbert.deploy.members import read_members
from mtbert.runtime import UserError

ENGINE_CHOICES = ("auto", "onnx", "int8", "torch")


class EngineChoiceError(UserError, ValueError):
    """The engine asked for cannot run the folder given (an export on PyTorch, a trained folder on ONNX)."""


def load_predictor(*, model: Path | None, ensemble: Path | None, models_dir: Path, engine: str = "auto",
                   batch_size: int = 128, threads: int = 0, bf16: bool = False):
    """The predictor of `model` (a folder) or of `ensemble` (metrics/ensemble.json over `models_dir`)."""
    if engine not in ENGINE_CHOICES:
        raise EngineChoiceError(f"--engine {engine!r}: expected one of {', '.join(ENGINE_CHOICES)}")
    folders = [Path(model)] if model is not None else member_folders(Path(ensemble), Path(models_dir))
    onnx = engine in ("onnx", "int8") or (engine == "auto" and all(is_export(folder) for folder in folders))
    if onnx:
        return onnx_predictor(model, ensemble, models_dir, folders, engine, batch_size, threads, bf16)
    return torch_predictor(model, ensemble, models_dir, folders, batch_size, threads, bf16)


def serving_predictor(config):
    """The model `mtbert serve` serves (a ServeConfig's), every graph loaded and checked: a truncated or
    foreign graph fails here, in one line. The server is handed this function: mtbert/deploy/ imports
    nothing from above it, PyTorch's predictors included."""
    predictor = load_predictor(model=config.model and Path(config.model),
                               ensemble=config.ensemble and Path(config.ensemble), models_dir=Path(config.models_dir),
                               engine=config.engine, batch_size=config.batching.max_batch, threads=config.threads)
    if hasattr(predictor, "warm"):
        predictor.warm()
    return predictor


def member_folders(ensemble: Path, models_dir: Path) -> list[Path]:
    members = read_members(ensemble)
    return [models_dir / name for name in sorted({name for order in members.values() for name in order})]


def onnx_predictor(model, ensemble, models_dir, folders: list[Path], engine: str, batch_size: int, threads: int,
                   bf16: bool):
    trained = [folder for folder in folders if not is_export(folder)]
    if trained:
        raise EngineChoiceError(f"{trained[0]} is not an export (no manifest.json), so ONNX Runtime cannot run it; "
                                f"write one with `mtbert export --model {trained[0]} --out exports/"
                                f"{trained[0].name}` (or `dvc repro export@<variant>`), or use --engine torch")
    if bf16:
        raise EngineChoiceError("--bf16 is for --engine torch: an export's graphs run in fp32 (onnx) or int8")
    options = {"engine": engine, "batch_size": batch_size, "threads": threads}
    if model is not None:
        return load_export(model, **options)
    return OnnxEnsemblePredictor.load(ensemble, models_dir, **options)


def torch_predictor(model, ensemble, models_dir, folders: list[Path], batch_size: int, threads: int, bf16: bool):
    exported = [folder for folder in folders if is_export(folder)]
    if exported:
        raise EngineChoiceError(f"{exported[0]} is an export (ONNX graphs), which PyTorch cannot run; give the "
                                "trained variant's folder (models/<variant>) for --engine torch, or use an "
                                "ONNX engine for every folder")
    quiet_transformers()
    from mtbert.inference import EnsemblePredictor, Predictor  # after quieting: tqdm reads its env on import
    from mtbert.runtime import setup_torch

    device = setup_torch(seed=0, threads=threads)
    options = {"batch_size": batch_size, "bf16": bf16, "device": device}
    if model is not None:
        return Predictor.load(model, **options)
    return EnsemblePredictor.load(ensemble, models_dir, **options)


def quiet_transformers() -> None:
    """stderr is for errors: no loading or tokenizing progress bars."""
    import os

    os.environ.setdefault("TQDM_DISABLE", "1")  # before anything imports tqdm, which reads it then
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
