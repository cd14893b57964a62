"""The pattern table is complete data: every entry names a lowering that exists, and the
parameters a lowering needs are fields of the entry, not read back out of its name."""

from tpp_tvm.relay_passes.lower import LOWERINGS
from tpp_tvm.relay_passes.patterns import pattern_table


def test_every_pattern_has_a_lowering():
    table = pattern_table()
    assert {p.lowering for p in table} == set(LOWERINGS)
    names = [p.name for p in table]
    assert len(names) == len(set(names)), "pattern names must be unique (they key the table)"


def test_lowering_parameters_are_fields():
    table = {p.name: p for p in pattern_table()}
    assert table["tpp.attention_mask_mulscale"].scale_multiplies
    assert not table["tpp.attention_mask"].scale_multiplies
    assert table["tpp.conv2d_runtime_weight"].lowering == "conv2d"
    relu_dense = table["tpp.dense_bias_relu_residual"]
    assert (relu_dense.lowering, relu_dense.activation) == ("dense", "relu")
    assert table["tpp.dense_bias_residual_relu"].post_activation == "relu"
