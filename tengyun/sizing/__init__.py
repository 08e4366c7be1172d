"""Sizing: what a model costs on a device, in pure Python (no torch, no engine). Shared by the
engine (EngineConfig.finalize, Worker) and `tengyun plan`: the resolve of the settings that size
the caches, model parameters per rank, KV and state shapes, and one budget turned into blocks."""
