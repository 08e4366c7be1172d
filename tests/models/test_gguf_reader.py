"""A conversion parses a .gguf header once (models/gguf_reader.py): one reader per file inside
shared_readers(), ours and transformers' alike, a fresh one outside it, and a file rewritten
meanwhile is parsed again."""

from __future__ import annotations

import gguf
import numpy as np

from tengyun.models.gguf_reader import gguf_reader, shared_readers


def _write_gguf(path, rows: int):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.arange(rows * 4, dtype=np.float32).reshape(rows, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_one_reader_per_file_inside_the_scope_and_a_fresh_one_outside(tmp_path):
    a, b = _write_gguf(tmp_path / "a.gguf", 2), _write_gguf(tmp_path / "b.gguf", 3)
    assert gguf_reader(a) is not gguf_reader(a)
    with shared_readers():
        first = gguf_reader(a)
        assert gguf_reader(a) is first and gguf_reader(b) is not first
        with shared_readers():  # nested: the outer scope's readers
            assert gguf_reader(a) is first
        assert [t.name for t in first.tensors] == ["token_embd.weight"]
    with shared_readers():
        assert gguf_reader(a) is not first


def test_a_file_rewritten_inside_the_scope_is_parsed_again(tmp_path):
    path = _write_gguf(tmp_path / "a.gguf", 2)
    with shared_readers():
        before = gguf_reader(path)
        _write_gguf(path, 5)
        after = gguf_reader(path)
        assert after is not before and list(after.tensors[0].shape) == [4, 5]


def test_transformers_loading_inside_the_scope_parses_no_header_of_its_own(tmp_path, monkeypatch):
    """transformers' GGUF loaders build ``gguf.GGUFReader(path)`` (imported by name when they run):
    inside the scope that is the shared reader; outside it, and for a writable mode, the class."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    parsed = []

    class CountingReader(gguf.GGUFReader):
        def __init__(self, path, mode="r"):
            parsed.append((str(path), mode))
            super().__init__(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    path = _write_gguf(tmp_path / "a.gguf", 2)
    with shared_readers():
        ours = gguf_reader(path)
        for _ in range(3):  # as a conversion does: config, tensors, tokenizer
            assert load_gguf_checkpoint(str(path), return_tensors=False)["config"]["model_type"] == "llama"
        assert gguf.GGUFReader(str(path)) is ours
        assert isinstance(gguf.GGUFReader(str(path), "c"), CountingReader)  # writable: its own reader
    assert parsed == [(str(path), "r"), (str(path), "c")]
    assert gguf.GGUFReader is CountingReader
    load_gguf_checkpoint(str(path), return_tensors=False)
    assert len(parsed) == 3
