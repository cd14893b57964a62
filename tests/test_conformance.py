"""ONNX backend conformance: tpp_tvm is never worse than TVM's own default build.

Every case runs through both builds (``conformance.py``); a case that TVM's build gets
right and tpp_tvm does not fails, unless ``conformance_known.json`` lists it as a known
tpp_tvm gap with its reason. TVM's own failures are data in the same file: a case listed
there that TVM now passes fails too, so a TVM fix shows up (and then tpp_tvm must pass it).

The default run takes a fixed sample across the operator families tpp_tvm maps onto TPPs
(MatMul/Gemm/Conv, pooling, normalization, element-wise, Softmax, attention-like chains)
plus a few of TVM's failures; ``-m slow`` runs every case of every suite.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import conformance
import pytest

pytest.importorskip("onnx.backend.test.case.node", reason="onnx ships the node cases")

#: The fast sample: cases of the operators the pattern table handles and their neighbours.
SAMPLE = [
    "node/test_matmul_2d", "node/test_matmul_3d", "node/test_matmul_4d",
    "node/test_gemm_default_no_bias", "node/test_gemm_all_attributes",
    "node/test_gemm_transposeB", "node/test_gemm_default_vector_bias", "node/test_gemm_alpha",
    "node/test_basic_conv_with_padding", "node/test_conv_with_strides_padding",
    "node/test_conv_with_autopad_same", "node/test_conv_with_strides_and_asymmetric_padding",
    "node/test_maxpool_2d_default", "node/test_maxpool_2d_pads", "node/test_maxpool_2d_strides",
    "node/test_averagepool_2d_pads_count_include_pad", "node/test_averagepool_2d_strides",
    "node/test_globalaveragepool", "node/test_globalmaxpool",
    "node/test_batchnorm_example", "node/test_instancenorm_example",
    "node/test_softmax_axis_1", "node/test_softmax_default_axis", "node/test_logsoftmax_axis_1",
    "node/test_relu", "node/test_sigmoid", "node/test_tanh", "node/test_leakyrelu",
    "node/test_clip_default_inbounds", "node/test_gelu_default_1_expanded",
    "node/test_gelu_tanh_1", "node/test_erf", "node/test_lrn", "node/test_matmul_1d_3d",
    "node/test_add_bcast", "node/test_mul_bcast", "node/test_div_bcast",
    "node/test_transpose_all_permutations_0", "node/test_flatten_axis1",
    "node/test_dropout_default_mask", "node/test_slice", "node/test_unique_sorted_with_axis",
    "node/test_optional_get_element_optional_tensor",
    "pytorch-converted/test_Conv2d_groups", "pytorch-converted/test_Conv2d_depthwise_strided",
    "pytorch-converted/test_Linear", "pytorch-operator/test_operator_addmm",
    "simple/test_single_relu_model",
    # TVM's own failures (the data list must keep saying so)
    "node/test_sequence_insert_at_back", "node/test_attention_3d",
    "node/test_layer_normalization_3d_axis_negative_1_epsilon",
]


def check(result: conformance.Result, known: dict[str, dict[str, str]]) -> None:
    """The promise for one case, and the data lists kept honest."""
    name = result.name
    if result.regression:
        if name in known["tpp_gaps"]:
            pytest.xfail(f"known tpp_tvm gap: {known['tpp_gaps'][name]}")
        pytest.fail(f"{name}: TVM's default build passes, tpp_tvm does not: {result.tpp}")
    listed = name in known["tvm_failures"]
    if listed and result.tvm == "pass":
        pytest.fail(f"{name}: TVM's default build passes now; remove it from tvm_failures "
                    f"in {conformance.KNOWN.name}")
    if not listed and result.tvm != "pass":
        pytest.fail(f"{name}: TVM's default build fails ({result.tvm}); add it to "
                    f"tvm_failures in {conformance.KNOWN.name} if that is TVM's bug")


@pytest.fixture(scope="module")
def known() -> dict[str, dict[str, str]]:
    return conformance.known()


@pytest.fixture(scope="module")
def sample_results() -> dict[str, conformance.Result]:
    with conformance.Runner(timeout=120) as runner:
        return {name: runner.run(name) for name in SAMPLE}


@pytest.mark.parametrize("name", SAMPLE)
def test_sample_case(sample_results, known, name: str) -> None:
    check(sample_results[name], known)


def test_sample_cases_exist() -> None:
    names = {c.name for c in conformance.all_cases()}
    assert not set(SAMPLE) - names


def test_known_lists_name_real_cases(known) -> None:
    names = {c.name for c in conformance.all_cases()}
    for section in ("tvm_failures", "tpp_gaps"):
        assert not set(known[section]) - names, section


def test_compare_treats_nan_as_equal_and_checks_shapes() -> None:
    import numpy as np

    nan = np.array([1.0, np.nan])
    assert conformance.compare([nan], [nan.copy()]) == "pass"
    assert conformance.compare([nan], [np.array([1.0, 2.0])]).startswith("mismatch")
    assert conformance.compare([nan], [nan[:1]]).startswith("mismatch: output 0 shape")
    assert conformance.compare([nan], []).startswith("mismatch: 0 outputs")


def test_a_crash_is_a_failure_of_that_case_only(monkeypatch) -> None:
    """An abort in one case (LLVM's ``abort()``) fails that case; the next one runs."""
    monkeypatch.setenv("TPP_CONFORMANCE_ABORT", "node/test_relu")
    with conformance.Runner(timeout=120) as runner:
        crashed = runner.run("node/test_relu")
        after = runner.run("node/test_abs")
    assert crashed.tvm.startswith("crash: worker died of signal")
    assert after.tvm == after.tpp == "pass"


@pytest.mark.slow
def test_every_case() -> None:
    """All suites: no regression outside the known gaps, TVM's failures exactly the list."""
    known = conformance.known()
    out = Path(tempfile.gettempdir()) / "tpp_tvm_conformance_results.json"
    names = [c.name for c in conformance.all_cases()]
    assert conformance.main([*names, "-o", str(out), "--timeout", "300"]) in (0, 1)
    results = [conformance.Result(**r) for r in json.loads(out.read_text())["results"]]
    regressions = {r.name: r.tpp for r in results
                   if r.regression and r.name not in known["tpp_gaps"]}
    assert not regressions
    tvm_failed = {r.name for r in results if r.tvm != "pass"}
    assert not tvm_failed - set(known["tvm_failures"]), "new TVM failures"
    assert not set(known["tvm_failures"]) - tvm_failed, "TVM fixed these: update the list"
