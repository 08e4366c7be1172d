"""The class AutoTokenizer chose for a tokenizer folder, recorded so that later starts load that
class directly (tokenizer.get_tokenizer). AutoTokenizer reads the model's config through
AutoConfig, which imports the model type's configuration module and with it
torch.distributed.tensor: ~1 s of an engine's start on 2 cores. The class alone loads the same
tokenizer (tests/test_tokenizer.py), as the API process has done since it learnt the engine's.

A record is cache_dir()/tokenizer-classes/<key> holding "module:class", key = sha256 of what
AutoTokenizer's choice reads: the folder's absolute path (transformers matches it against model
ids), the name, size and mtime_ns of every file in it but the weights, and transformers' version.
Editing a file or upgrading transformers makes a new key; a record whose class no longer loads
falls back to AutoTokenizer, which records again. Remote code is never recorded.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from tengyun.cache_dir import cache_dir

logger = logging.getLogger(__name__)

RECORDS = "tokenizer-classes"
_WEIGHTS = (".safetensors", ".bin", ".gguf", ".pt", ".pth")  # large, and not read by the choice


def record_path(folder: Path) -> Path | None:
    """Where the record for ``folder`` lives, or None when the folder cannot be listed."""
    try:
        stats = [(entry.name, entry.stat()) for entry in os.scandir(folder)
                 if entry.is_file() and not entry.name.endswith(_WEIGHTS)]
        files = sorted((name, st.st_size, st.st_mtime_ns) for name, st in stats)
        transformers_version = version("transformers")
    except (OSError, PackageNotFoundError):
        return None
    ident = repr((str(Path(folder).resolve()), files, transformers_version))
    return cache_dir() / RECORDS / hashlib.sha256(ident.encode()).hexdigest()[:32]


def recorded_class(folder: Path) -> str | None:
    """The "module:class" AutoTokenizer chose for ``folder`` as it is now, if recorded."""
    path = record_path(folder)
    if path is None:
        return None
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def record_class(folder: Path, class_path: str) -> None:
    """Keep AutoTokenizer's choice for ``folder``; a cache that cannot be written is skipped."""
    path = record_path(folder)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    except OSError as e:
        logger.debug("Could not record the tokenizer class in %s (%s)", path.parent, e)
        return
    try:
        with os.fdopen(fd, "w") as out:
            out.write(class_path + "\n")
        os.replace(tmp, path)  # whole or absent: two engines starting at once may both write
    except OSError as e:
        logger.debug("Could not record the tokenizer class in %s (%s)", path.parent, e)
        Path(tmp).unlink(missing_ok=True)
