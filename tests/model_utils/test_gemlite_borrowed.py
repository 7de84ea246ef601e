"""Configs borrowed from the nearest tuned shape (gemlite_borrowed), on tables in gemlite's own
format: which shape lends, at which row buckets, and what is never borrowed."""

from __future__ import annotations

import pytest

from model_utils.layers import gemlite_borrowed
from model_utils.layers.gemlite_borrowed import borrow, borrowed_configs, parse_key

INT4 = (128, 8, 104)  # group size, elements per sample, type id of the app's int4 in bf16


@pytest.fixture(autouse=True)
def own_records(monkeypatch):
    """What a test borrows stays its own (the records are the process's)."""
    monkeypatch.setattr(gemlite_borrowed, "BORROWED", set())
    monkeypatch.setattr(gemlite_borrowed, "_SEEN", set())


def key(rows: int, n: int, k: int, kind: tuple = INT4) -> str:
    return str((rows, n, k, *kind))


def config(depth: int, width: int = 64, split: int = 1, tag: str = "") -> dict:
    return {"BLOCK_SIZE_K": depth, "BLOCK_SIZE_N": width, "SPLIT_K": split, "tag": tag}


def test_the_nearest_shape_of_the_same_kind_lends_each_bucket_it_has():
    table = {"GEMM_SPLITK": {key(8, 3584, 3584): config(64, tag="o"),
                             key(8, 4608, 3584): config(64, tag="qkv"),
                             key(32, 4608, 3584): config(32, tag="qkv32"),
                             key(8, 4096, 3584, (64, 8, 104)): config(64, tag="other group")}}
    found = borrowed_configs(table, (4096, 3584, *INT4))
    assert {k: c["tag"] for k, c in found.items()} == {
        ("GEMM_SPLITK", key(8, 4096, 3584)): "qkv",  # 4608 is nearer 4096 than 3584 is
        ("GEMM_SPLITK", key(32, 4096, 3584)): "qkv32"}


def test_a_bucket_the_shape_has_is_kept_and_tiles_that_do_not_divide_it_are_passed_over():
    table = {"GEMM_SPLITK": {key(8, 5120, 5120): config(128, split=16, tag="too deep"),
                             key(8, 3584, 3584): config(64, split=4, tag="fits"),
                             key(16, 5120, 5120): config(64, tag="own bucket's")},
             "GEMV_REVSPLITK": {key(1, 5120, 5120): config(32, width=8192, tag="too wide"),
                                key(1, 3584, 3584): config(32, width=3584, tag="not a divisor")}}
    shape = (5120, 17408, *INT4)  # 17408 = 2^10 * 17: no multiple of 2048
    table["GEMM_SPLITK"][key(16, 5120, 17408)] = config(32, tag="its own")
    found = borrowed_configs(table, shape)
    assert {k: c["tag"] for k, c in found.items()} == {
        ("GEMM_SPLITK", key(8, 5120, 17408)): "fits"}


def test_per_row_scales_are_one_kind_whatever_the_row_length():
    """8-bit weights have one scale a row: gemlite keys them with the row's length as group."""
    row_scaled = {"GEMV_SPLITK": {key(1, 3584, 18944, (18944, 1, 108)): config(512, tag="down")}}
    found = borrowed_configs(row_scaled, (5120, 17408, 17408, 1, 108))
    assert [c["tag"] for c in found.values()] == ["down"]
    assert list(found) == [("GEMV_SPLITK", key(1, 5120, 17408, (17408, 1, 108)))]


def test_borrowing_fills_the_table_once_a_shape_and_records_what_it_borrowed():
    table = {"GEMM": {key(64, 3584, 3584): config(64, tag="o")}}
    shape = (2048, 3584, *INT4)
    keys = borrow(table, shape)
    assert keys == [key(64, 2048, 3584)] and table["GEMM"][keys[0]]["tag"] == "o"
    assert ("GEMM", keys[0]) in gemlite_borrowed.BORROWED
    assert parse_key(keys[0]) == (64, *shape)
    del table["GEMM"][keys[0]]
    assert borrow(table, shape) == []  # once a shape in a process
