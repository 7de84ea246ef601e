"""gemlite configs borrowed from the nearest tuned weight shape, for shapes this GPU has none for.

gemlite tunes a weight shape at each row bucket's first use: tens of seconds each, minutes for a
model whose shapes neither gemlite's file nor this app's (gemlite_configs/) holds (a switch to
int4-wo on a four-shape test model took 236 s, BENCHMARKS.md). A config is a tiling, valid for
any shape of the same kind whose sizes its tiles divide, and the configs tuned for a nearby
shape are a fair guess. So before a layer's kernels are first launched, every kernel type and
row bucket that the table holds for shapes of the layer's kind (group size, elements per
sample, input type) but not for its own shape gets the config of the nearest such shape (sizes
compared on a log scale) whose tiles divide the layer's sizes. The load check launches those
of the decode rows and of the prefill graphs (up to 1 024 rows) and holds them to the weights'
numbers like any other (gemlite_checks); one that fails there is tuned for the shape. Longer
prompts' larger buckets run borrowed configs unchecked, as they run shipped ones.

Borrowed configs are not kept with what a load tunes (gemlite_weights.save_tuned): the next load
borrows again, and a shape tuned for real (benchmarks/gemlite_search.py --held-only, shipped in
gemlite_configs/) replaces them.
"""

from __future__ import annotations

import math

# (kernel type, key) of every config borrowed in this process: left out of the kept file.
BORROWED: set[tuple[str, str]] = set()


def parse_key(key: str) -> tuple[int, ...]:
    """gemlite's key "(rows bucket, N, K, group size, elements per sample, type id)"."""
    return tuple(int(part) for part in key.strip("()").split(","))


def _kind(n: int, k: int, group: int, per_sample: int, type_id: int) -> tuple:
    # A group as long as the row is a per-row scale: shapes of every K share that kind.
    return ("row" if group == k else group, per_sample, type_id)


def fits(config: dict, matmul_type: str, n: int, k: int) -> bool:
    """Whether the config's tiles divide this shape: K by a tile's depth times its split (the
    reversed split-K GEMV always splits in two), N by its width (gemlite's kernels read a
    tile's scales unmasked)."""
    split = 2 if matmul_type == "GEMV_REVSPLITK" else config.get("SPLIT_K", 1)
    depth, width = config.get("BLOCK_SIZE_K", 1), config.get("BLOCK_SIZE_N", 1)
    return k % (depth * split) == 0 and n % width == 0


def borrowed_configs(table: dict[str, dict[str, dict]], shape: tuple[int, ...]
                     ) -> dict[tuple[str, str], dict]:
    """{(kernel type, key): config} for `shape` (N, K, group size, elements per sample, type
    id) at every kernel type and row bucket `table` (gemlite's GEMLITE_TRITON_CONFIG_CACHE)
    holds for shapes of its kind but not for it: the nearest such shape's fitting config."""
    n, k = shape[:2]
    kind = _kind(*shape)
    borrowed = {}
    for matmul_type, configs in table.items():
        nearest: dict[int, tuple[float, dict]] = {}  # bucket -> (distance, config)
        for key, config in configs.items():
            bucket, *other = parse_key(key)
            if len(other) != 5 or _kind(*other) != kind or tuple(other) == tuple(shape):
                continue
            if str((bucket, *shape)) in configs or not fits(config, matmul_type, n, k):
                continue
            distance = abs(math.log2(other[0] / n)) + abs(math.log2(other[1] / k))
            if bucket not in nearest or distance < nearest[bucket][0]:
                nearest[bucket] = (distance, config)
        for bucket, (_, config) in nearest.items():
            borrowed[(matmul_type, str((bucket, *shape)))] = dict(config)
    return borrowed


def borrow(table: dict[str, dict[str, dict]], shape: tuple[int, ...]) -> list[str]:
    """Fill `table` (gemlite's) for `shape` from the nearest tuned shapes of its kind, once a
    shape in a process (see the module doc): the keys borrowed, [] when it lacks none."""
    if shape in _SEEN:
        return []
    _SEEN.add(shape)
    found = borrowed_configs(table, shape)
    for (matmul_type, key), config in found.items():
        table[matmul_type][key] = config
    BORROWED.update(found)
    return [key for _, key in found]


_SEEN: set[tuple[int, ...]] = set()
