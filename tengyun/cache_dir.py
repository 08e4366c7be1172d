"""Where Tengyun keeps what it derives from a model once (converted GGUF folders, downloaded
embedded models, recorded tokenizer classes): $TENGYUN_CACHE_DIR, else ~/.cache/tengyun."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$TENGYUN_CACHE_DIR, else ~/.cache/tengyun."""
    env = os.environ.get("TENGYUN_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tengyun"
