"""Models named by their Hugging Face Hub id, through ``huggingface_hub``'s cache.

``Qwen/Qwen3-0.6B`` (a safetensors repo) resolves to the snapshot folder of the files a loader
reads (config, generation config, tokenizer and chat template files, the safetensors shards and
their index); ``org/name-GGUF:Q4_K_M`` to one GGUF file of the repo, picked by its quantization
(as llama-server's ``-hf`` and Ollama's ``hf.co/`` take it; without ``:QUANT``, Q4_K_M, or the
repo's only one). The cache is looked at first: a model already there loads without a request to
the Hub, so a second start needs no network. ``HF_TOKEN``, ``HF_HOME``/``HF_HUB_CACHE``,
``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` are huggingface_hub's own. Every failure is one
``ModelNotFound`` line that says what to do (``hub_error`` maps huggingface_hub's exceptions).
"""

from __future__ import annotations

import json
import os
import re
from fnmatch import fnmatch
from pathlib import Path, PurePosixPath
from typing import Literal

from astrai.errors import ModelNotFound

__all__ = ["HF_FILES", "gguf_quant", "hub_error", "hub_model", "parse_hub_id"]

#: What ``snapshot_download`` fetches of a safetensors repo: what the loader and tokenizer read.
HF_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.json",
    "chat_template.jinja",
    "*.safetensors",
    "model.safetensors.index.json",
]
DEFAULT_QUANT = "Q4_K_M"  # llama-server's and the Hub's pick when the id names none

_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]")
_QUANT = re.compile(r"(?i)(?:^|[-._])((?:I?Q|TQ)\d(?:_[A-Z0-9]+)*|BF16|F16|F32|MXFP4(?:_[A-Z0-9]+)*)$")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})$")
_COMMIT = re.compile(r"[0-9a-f]{40}")


def parse_hub_id(name: str) -> tuple[str, str | None] | None:
    """``"org/name"`` -> ``("org/name", None)``, ``"org/name-GGUF:Q4_K_M"`` -> ``(..., "Q4_K_M")``;
    None for what is no Hub id (a path such as ``./x``, ``a/b/c`` or ``dir/file.gguf``). Whether
    a path of that name exists is the caller's question (an existing path wins)."""
    repo, _, quant = name.partition(":")
    if (
        not _REPO.fullmatch(repo)
        or "--" in repo
        or ".." in repo
        or repo.lower().endswith(".gguf")
        or (_ and not re.fullmatch(r"[\w.-]+", quant))
    ):
        return None
    return repo, quant or None


def gguf_quant(file_name: str) -> str | None:
    """The quantization a GGUF file's name ends with, upper case: ``Qwen3-0.6B-Q4_K_M.gguf`` ->
    ``Q4_K_M``, ``model-q8_0-00001-of-00002.gguf`` -> ``Q8_0``; None when the name has none."""
    stem = _SPLIT.sub("", PurePosixPath(file_name).name[: -len(".gguf")])
    found = _QUANT.search(stem)
    return found[1].upper() if found else None


def _offline() -> bool:
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    return bool(constants.HF_HUB_OFFLINE) or env


def _cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE).expanduser()


def _cached_snapshot(repo: str, revision: str | None) -> Path | None:
    """The cached snapshot folder of ``repo`` at ``revision`` (a branch, tag or commit), or None;
    read from the cache's layout (``models--org--name/refs/<revision>`` -> ``snapshots/<commit>``),
    with no request to the Hub."""
    storage = _cache_dir() / ("models--" + repo.replace("/", "--"))
    revision = revision or "main"
    commit = revision
    if not _COMMIT.fullmatch(revision):
        ref = storage / "refs" / revision
        if not ref.is_file():
            return None
        commit = ref.read_text(encoding="utf-8").strip()
    folder = storage / "snapshots" / commit
    return folder if folder.is_dir() else None


def _files(folder: Path) -> list[str]:
    """The files of a snapshot folder whose content is there (a link to a missing blob is not)."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def _hf_complete(folder: Path, files: list[str]) -> bool:
    """Whether a cached snapshot holds a loadable safetensors checkpoint: config.json and every
    shard its index names (or, without an index, a safetensors file)."""
    if "config.json" not in files:
        return False
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (ValueError, KeyError, TypeError):
            return False
        return shards <= set(files)
    return any(f.endswith(".safetensors") for f in files)


def _available(ggufs: list[str]) -> str:
    names = sorted({gguf_quant(f) or PurePosixPath(f).name for f in ggufs})
    return ", ".join(names) or "none"


def _pick_gguf(repo: str, ggufs: list[str], quant: str | None, where: str) -> str:
    """The GGUF file of ``ggufs`` (the repo's, or those cached: ``where`` says which) to load for
    ``quant``; raises ModelNotFound listing the quantizations there are."""
    want = (quant or DEFAULT_QUANT).upper()
    matches = [f for f in ggufs if gguf_quant(f) == want]
    if not matches:
        pattern = f"*{want.lower()}*.gguf"
        matches = [f for f in ggufs if fnmatch(PurePosixPath(f).name.lower(), pattern)]
    if not matches and quant is None and len({_SPLIT.sub("", f[:-5]) for f in ggufs}) == 1:
        matches = ggufs  # the repo's only model file
    if not matches:
        head = f"{repo} has no GGUF file of quantization {want}" if quant else f"{repo} has no {want}"
        example = gguf_quant(ggufs[0]) or "QUANT" if ggufs else "QUANT"
        raise ModelNotFound(
            f"{head} ({where}: {_available(ggufs)}); name one after a colon, e.g. {repo}:{example}"
        )
    split = [f for f in matches if _SPLIT.search(f[:-5])]
    if split:
        raise ModelNotFound(
            f"{repo}: {want} is split into several files ({PurePosixPath(min(split)).name}, ...); "
            "astrai reads a GGUF model from one file: merge them (llama-gguf-split --merge) and give "
            f"the merged file, or pick another quantization ({where}: {_available(ggufs)})"
        )
    if len(set(matches)) > 1:
        listed = ", ".join(PurePosixPath(f).name for f in matches)
        raise ModelNotFound(f"{repo}:{want} matches several files ({listed}); name the quantization exactly")
    return matches[0]


def _ggufs(files: list[str]) -> list[str]:
    """The model GGUF files among ``files``; a multimodal projector (``mmproj``) is none."""
    return [f for f in files if f.lower().endswith(".gguf") and "mmproj" not in f.lower()]


def _from_cache(
    repo: str, quant: str | None, revision: str | None
) -> tuple[Literal["gguf", "hf"], Path] | None:
    folder = _cached_snapshot(repo, revision)
    if folder is None:
        return None
    files = _files(folder)
    if quant is None and _hf_complete(folder, files):
        return "hf", folder
    ggufs = _ggufs(files)
    if not ggufs:
        return None
    try:
        return "gguf", folder / _pick_gguf(repo, ggufs, quant, "cached")
    except ModelNotFound as exc:
        if _offline():
            raise ModelNotFound(f"{_not_cached(repo, revision)}; {exc}") from None
        return None  # the Hub may have it


def _not_cached(repo: str, revision: str | None) -> ModelNotFound:
    at = f" (revision {revision})" if revision else ""
    return ModelNotFound(
        f"{repo}{at} is not in the Hugging Face cache ({_cache_dir()}) and HF_HUB_OFFLINE=1 forbids "
        "downloading it: run once without HF_HUB_OFFLINE to download it, or give a local path"
    )


def hub_model(
    repo: str, quant: str | None = None, revision: str | None = None
) -> tuple[Literal["gguf", "hf"], Path]:
    """("hf", snapshot folder) or ("gguf", file) of Hub repo ``repo`` at ``revision`` (default:
    main), from the cache when it is there, else downloaded into it. ``quant``: the GGUF
    quantization to pick (``Q4_K_M``; None: a safetensors repo's checkpoint, or a GGUF repo's
    Q4_K_M or only file). Raises ModelNotFound, one line saying what to do."""
    found = _from_cache(repo, quant, revision)
    if found is not None:
        return found
    if _offline():
        raise _not_cached(repo, revision)
    try:
        return _download(repo, quant, revision)
    except ModelNotFound:
        raise
    except Exception as exc:
        mapped = hub_error(exc, repo, revision)
        if mapped is None:
            raise
        raise mapped from exc


def _download(repo: str, quant: str | None, revision: str | None) -> tuple[Literal["gguf", "hf"], Path]:
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    files = HfApi().list_repo_files(repo, revision=revision)
    has_hf = "config.json" in files and any(f.endswith(".safetensors") for f in files)
    ggufs = _ggufs(files)
    if quant is None and has_hf:
        return "hf", Path(snapshot_download(repo, revision=revision, allow_patterns=HF_FILES))
    if not ggufs:
        raise ModelNotFound(
            f"{repo} holds neither a safetensors checkpoint (config.json and *.safetensors) nor a "
            ".gguf file; astrai cannot load it"
        )
    name = _pick_gguf(repo, ggufs, quant, "the repo has")
    return "gguf", Path(hf_hub_download(repo, name, revision=revision))


def hub_error(exc: BaseException, repo: str, revision: str | None = None) -> ModelNotFound | None:
    """The one-line ModelNotFound for huggingface_hub's failure ``exc`` on ``repo``, or None for
    an exception that is none of the Hub's."""
    from huggingface_hub import errors

    at = f" at revision {revision!r}" if revision else ""
    if isinstance(exc, errors.GatedRepoError):
        return ModelNotFound(
            f"{repo} is gated: accept its terms at https://huggingface.co/{repo} and set HF_TOKEN to "
            "a token of that account (https://huggingface.co/settings/tokens)"
        )
    if isinstance(exc, errors.RevisionNotFoundError):
        return ModelNotFound(
            f"{repo} has no revision {revision or 'main'!r}: give --revision a branch, tag or commit "
            f"it has (https://huggingface.co/{repo}/tree/main)"
        )
    if isinstance(exc, errors.RepositoryNotFoundError):
        return ModelNotFound(
            f"model {repo!r} is neither a local path nor a Hugging Face Hub repository: check the "
            "spelling; a private repository needs HF_TOKEN set to a token that can read it"
        )
    if isinstance(exc, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled)):
        if _offline():
            return _not_cached(repo, revision)
        return ModelNotFound(
            f"{repo}{at} is not in the Hugging Face cache ({_cache_dir()}) and the Hub could not be "
            "reached: check the network or proxy (HF_ENDPOINT), or give a local path"
        )
    if isinstance(exc, errors.EntryNotFoundError):
        return ModelNotFound(f"{repo}{at}: a file went missing while downloading ({exc}); try again")
    if isinstance(exc, errors.HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status == 401:
            return ModelNotFound(f"the Hub refused the token for {repo} (401): set HF_TOKEN to a valid token")
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return ModelNotFound(f"downloading {repo}{at} failed: {first}")
    if isinstance(exc, (ConnectionError, TimeoutError)) or type(exc).__module__.split(".")[0] in (
        "httpx",
        "httpx2",
        "requests",
    ):
        return ModelNotFound(
            f"{repo}{at} is not cached and the Hub could not be reached ({type(exc).__name__}: {exc}); "
            "check the network or proxy, or set HF_HUB_OFFLINE=1 and give a cached id or a local path"
        )
    return None
