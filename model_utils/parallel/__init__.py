"""Tensor parallelism: one model split over N worker processes that the engine starts itself
(`--tp N`). sharding (the split), worker (one rank), group (the processes, seen from the engine),
engine (the Engine surface over them)."""
