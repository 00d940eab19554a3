"""A GGUF file's tokenizer, converted once: transformers' GGUF converter builds the fast tokenizer from
the file's ``tokenizer.*`` metadata (about 1.3 s for the default model's 49k tokens, every start);
its saved form (``tokenizer.json`` and ``tokenizer_config.json``) loads in a fraction of that.

The converted tokenizer is kept under ``$XDG_CACHE_HOME/astrai/tokenizers`` (default
``~/.cache/astrai/tokenizers``), in a folder named by a hash of the file's resolved path, size and
modification time and of the transformers version that converted it: a changed file, or another
transformers, converts again. Written to a temporary folder and renamed into place, so a reader never
sees half a folder; any failure to read or write the cache falls back to converting (logged, never
raised). ``ASTRAI_TOKENIZER_CACHE=0`` turns the cache off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from astrai.model.shipped import model_cache

__all__ = ["cache_folder", "gguf_tokenizer"]

logger = logging.getLogger(__name__)


def cache_folder(path: Path) -> Path | None:
    """Where the converted tokenizer of GGUF file ``path`` is kept (None: the cache is off)."""
    if os.environ.get("ASTRAI_TOKENIZER_CACHE", "1") == "0":
        return None
    import transformers

    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    return model_cache().parent / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:24]


def gguf_tokenizer(path: Path, reader: Any = None) -> Any:
    """transformers' fast tokenizer of GGUF file ``path``, with the file's chat template: from the
    cache where it was converted before, else converted (``reader``: the file's open ``GGUFReader``,
    if the caller has one) and kept there."""
    from transformers import PreTrainedTokenizerFast

    folder = cache_folder(path)
    if folder is not None and (folder / "tokenizer.json").is_file():
        try:
            return PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
        except Exception:  # a damaged entry: convert again, and replace it
            logger.warning(
                "the cached tokenizer in %s could not be read; converting again", folder, exc_info=True
            )
            shutil.rmtree(folder, ignore_errors=True)
    # The generic fast class builds the same backend tokenizer as AutoTokenizer (transformers' GGUF
    # converter) without parsing the whole file for a model config just to pick a class.
    hf = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    if not hf.chat_template:
        from astrai.model.gguf_reader import open_gguf

        field = (reader or open_gguf(path)).fields.get("tokenizer.chat_template")
        hf.chat_template = None if field is None else field.contents()
    if folder is not None:
        _keep(hf, folder)
    return hf


def _keep(hf: Any, folder: Path) -> None:
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
        try:
            hf.save_pretrained(str(scratch))
            os.replace(scratch, folder) if not folder.exists() else shutil.rmtree(scratch)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
    except OSError as exc:  # a read-only or full disk: the next start converts again
        logger.info("the converted tokenizer was not cached in %s: %s", folder, exc)
