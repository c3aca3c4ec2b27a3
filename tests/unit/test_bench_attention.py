"""bench.attention's table and arguments without a GPU: the grouped-query and flash-attn-4
columns appear only for rows that have them."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("torch")

from bench.attention import _heads_list, format_table  # noqa: E402


def row(nheads=16, nheads_kv=16, batch=4, **tflops):
    return {"head_dim": 128, "causal": True, "seqlen": 4096, "batch": batch, "nheads": nheads,
            "nheads_kv": nheads_kv, "direction": "bwd", "tflops": tflops, "errors": {}}


def test_mha_rows_keep_the_protocols_columns():
    table = format_table([row(fagen=500, FA2=300, cuDNN=520)])
    assert "heads" not in table and "FA4" not in table
    assert "16384 tokens a row" in table


def test_gqa_and_flash_attn_4_columns():
    table = format_table([row(32, 8, fagen=500, FA2=300, cuDNN=520, FA4=560), row(fagen=400, cuDNN=400)])
    header, first, second = table.splitlines()[1], table.splitlines()[3], table.splitlines()[4]
    assert header.split()[:2] == ["heads", "batch"] and "f/FA4" in header
    assert first.split()[0] == "32:8" and "0.89" in first  # 500 / 560
    assert second.split()[0] == "16:16"


def test_batch_one_prefill_rows_name_their_heads():
    table = format_table([row(batch=1, fagen=500)])
    assert table.splitlines()[3].split()[:2] == ["16:16", "1"]


def test_heads_must_group_evenly():
    assert _heads_list("32:8,28:4") == [(32, 8), (28, 4)]
    with pytest.raises(argparse.ArgumentTypeError):
        _heads_list("3:2")
