"""Executors: how the engine process reaches its workers (one thread in this process today;
several processes or Ray workers behind the same interface)."""
