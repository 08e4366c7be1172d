"""One parsed .gguf header per file while a conversion runs.

gguf.GGUFReader parses the whole header on construction, each vocabulary string a numpy memmap
slice: ~2.4 s for SmolLM2-135M's (49,152 strings), ~7.3 s for Qwen2.5-Coder-0.5B's (151,936 strings
and their merges; AMD EPYC VM, 2026-12-06). A conversion asks for it from several places: ours (the
kept types, the config's extra fields, the tensor stream) and transformers' (its config, tensor and
tokenizer loaders each build a reader). Inside ``shared_readers()`` all of them get one reader per
file: ``gguf_reader`` returns it, and ``gguf.GGUFReader``, which transformers imports by name when
it loads, is swapped for a function that does the same until the scope ends. Outside the scope
each call parses afresh (a reader maps the whole file, so none is kept past the conversion).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

_shared: dict[tuple[str, int, int], object] | None = None  # (path, size, mtime_ns) -> reader, inside shared_readers
_reader_class = None  # gguf.GGUFReader itself, while shared_readers has swapped it out


def gguf_reader(gguf_file: Path):
    """gguf.GGUFReader of ``gguf_file``: the conversion's shared one inside shared_readers()."""
    import gguf

    if _shared is None:
        return gguf.GGUFReader(str(gguf_file))
    stat = Path(gguf_file).stat()
    key = (str(Path(gguf_file).resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _shared:
        _shared[key] = _reader_class(str(gguf_file))
    return _shared[key]


def _shared_or_new(path, mode: str = "r"):
    """What ``gguf.GGUFReader(path, mode)`` returns inside shared_readers(): the shared reader when
    read-only, a new one of the real class for the writable modes."""
    return gguf_reader(Path(path)) if mode == "r" else _reader_class(path, mode)


@contextlib.contextmanager
def shared_readers() -> Iterator[None]:
    """Within: each file's header is parsed once, by our readers and transformers' alike. Nested
    uses share the outer scope. The swap of gguf.GGUFReader is process-wide while it lasts."""
    global _shared, _reader_class
    if _shared is not None:
        yield
        return
    import gguf

    _shared, _reader_class = {}, gguf.GGUFReader
    gguf.GGUFReader = _shared_or_new
    try:
        yield
    finally:
        gguf.GGUFReader = _reader_class
        _shared, _reader_class = None, None
