"""Executors: how the engine process reaches its workers (one step thread in this process,
or one process per tensor-parallel rank, behind the same interface)."""
