"""Tests of the lowering report's rows (tpp_tvm.relay_passes.report): their text, their
sidecar form, and the format-1 labels read back into rows."""

from __future__ import annotations

from collections import Counter

import pytest

from tpp_tvm.relay_passes.report import (
    AMX,
    KernelRow,
    LoweringReport,
    labels,
    rows_from_json,
    rows_from_labels,
    rows_to_json,
)

ROWS = Counter({
    KernelRow("tpp.dense_bias", "dense"): 3,
    KernelRow("tpp.dense_bias_gelu", "dense", "bfloat16"): 2,
    KernelRow("tpp.conv2d_bias_relu", "conv2d", "bfloat16", AMX): 1,
    KernelRow("tpp.qdq_matmul_bias", "int8_matmul", "int8", AMX): 4,
    KernelRow("tpp.conv_integer", "int8_conv2d", "int16"): 1,
    KernelRow("tpp.layer_norm", "layer_norm", tuned=True): 1,
    KernelRow("tpp.gelu_inv", "backward"): 1,
})

#: ROWS as the report shows them (and as format-1 sidecars stored them).
TEXT = {"tpp.dense_bias": 3, "tpp.dense_bias_gelu [bf16]": 2,
        "tpp.conv2d_bias_relu [bf16, amx]": 1, "tpp.qdq_matmul_bias [int8, amx]": 4,
        "tpp.conv_integer [int8 via int16]": 1, "tpp.layer_norm (tuned)": 1,
        "tpp.gelu_inv": 1}


def test_rows_render_as_the_report_text() -> None:
    assert dict(labels(ROWS)) == TEXT
    report = LoweringReport(kernels=ROWS.copy())
    assert dict(report.lowered) == TEXT
    assert report.summary().splitlines()[0] == "  tpp.conv2d_bias_relu [bf16, amx]: 1"


def test_rows_say_tiles_and_quantization_as_fields() -> None:
    row = KernelRow("tpp.qdq_matmul_bias", "int8_matmul", "int8", AMX)
    assert row.on_tiles and row.quantized
    assert KernelRow("tpp.conv_integer", "int8_conv2d", "int16").quantized
    assert not KernelRow("tpp.dense", "dense", "bfloat16").quantized


def test_rows_round_trip_through_json() -> None:
    assert rows_from_json(rows_to_json(ROWS)) == ROWS


def test_format1_labels_become_rows_without_their_family() -> None:
    unrecorded = Counter({KernelRow(r.pattern, "", r.precision, r.unit, r.tuned): n
                          for r, n in ROWS.items()})
    assert rows_from_labels(TEXT) == unrecorded


def test_a_pattern_with_brackets_of_no_precision_stays_whole() -> None:
    rows = rows_from_labels({"tpp.odd [note]": 1})
    assert rows == Counter({KernelRow("tpp.odd [note]"): 1})


@pytest.mark.parametrize("fields", [{"unit": "gpu"}, {"precision": "float16"}])
def test_a_row_of_an_unknown_unit_or_precision_is_refused(fields: dict) -> None:
    with pytest.raises(ValueError, match="tpp.dense"):
        KernelRow("tpp.dense", "dense", **fields)
