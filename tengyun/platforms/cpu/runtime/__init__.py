"""Allocator, huge pages, OpenMP threads and decode graphs: what the CPU platform tunes per process."""
