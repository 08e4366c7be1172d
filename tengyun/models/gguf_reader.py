"""One parsed .gguf header per file while a conversion runs.

gguf.GGUFReader parses the whole header on construction: ~2 s for SmolLM2-135M's (49,152 vocabulary
strings, each a numpy memmap slice), more for Qwen2.5's larger vocabulary. A conversion asks for it from
several places (the kept types, the config's extra fields, the tensor stream); inside
``shared_readers()`` they get one reader per file, and outside it each call parses afresh (a
reader maps the whole file, so none is kept past the conversion).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

_shared: dict[tuple[str, int, int], object] | None = None  # (path, size, mtime_ns) -> reader, inside shared_readers


def gguf_reader(gguf_file: Path):
    """gguf.GGUFReader of ``gguf_file``: the conversion's shared one inside shared_readers()."""
    import gguf

    if _shared is None:
        return gguf.GGUFReader(str(gguf_file))
    stat = Path(gguf_file).stat()
    key = (str(Path(gguf_file).resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _shared:
        _shared[key] = gguf.GGUFReader(str(gguf_file))
    return _shared[key]


@contextlib.contextmanager
def shared_readers() -> Iterator[None]:
    """Within: gguf_reader parses each file once. Nested uses share the outer scope."""
    global _shared
    if _shared is not None:
        yield
        return
    _shared = {}
    try:
        yield
    finally:
        _shared = None
