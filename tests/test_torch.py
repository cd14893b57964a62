"""The PyTorch front door: compile_torch and torch.compile(backend="tpp_tvm") run on the
kernels the ONNX route reaches, match eager, and never fail a model eager can run."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tpp_tvm  # noqa: E402
from tpp_tvm.errors import UnsupportedShapeError  # noqa: E402


class ConvNet(torch.nn.Module):
    """Convolutions with batch norms (torch.export keeps them apart), ReLU, a pool, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16)
        self.c2 = torch.nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False)
        self.b2 = torch.nn.BatchNorm2d(32)
        self.fc = torch.nn.Linear(32, 10)

    def forward(self, x):
        x = torch.relu(self.b1(self.c1(x)))
        x = torch.relu(self.b2(self.c2(x)))
        return self.fc(x.mean((2, 3)))


def _convnet() -> torch.nn.Module:
    torch.manual_seed(0)
    model = ConvNet().eval()
    for bn in (model.b1, model.b2):  # statistics a trained model has, not the identity
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.data.normal_()
        bn.bias.data.normal_()
    return model


def _close(got, want, tol: float = 1e-4) -> None:
    scale = float(want.abs().max()) or 1.0
    assert float((got - want).abs().max()) / scale < tol


def _both_routes(model: torch.nn.Module, x: torch.Tensor, tmp_path) -> tuple:
    """``model`` through ``compile_torch`` (checked against eager) and the TPP kernels of
    its ONNX export's build."""
    compiled = tpp_tvm.compile_torch(model, (x,))
    with torch.no_grad():
        _close(compiled(x), model(x))
    path = tmp_path / "model.onnx"
    torch.onnx.export(model, (x,), str(path), opset_version=17, dynamo=False)
    return compiled, tpp_tvm.compile_onnx(str(path)).report_data["lowered"]


@pytest.fixture(scope="module")
def convnet():
    model, x = _convnet(), torch.randn(2, 3, 32, 32)
    return model, x, tpp_tvm.compile_torch(model, (x,))


def test_compile_torch_matches_eager_on_the_onnx_routes_kernels(convnet, tmp_path) -> None:
    """Batch norms fold into the convolutions (bias + ReLU epilogues), as the ONNX export
    folds them: both routes report the same TPP kernels."""
    model, x, compiled = convnet
    with torch.no_grad():
        want = model(x)
    got = compiled(x)
    assert isinstance(got, torch.Tensor) and got.shape == want.shape
    _close(got, want)
    lowered = compiled.report_data["lowered"]
    assert lowered.get("tpp.conv2d_bias_relu") == 2, compiled.report()
    path = tmp_path / "convnet.onnx"
    torch.onnx.export(model, (x,), str(path), opset_version=17, dynamo=False)
    onnx_route = tpp_tvm.compile_onnx(str(path))
    assert onnx_route.report_data["lowered"] == lowered


def test_export_and_load_torch(convnet, tmp_path) -> None:
    model, x, compiled = convnet
    loaded = tpp_tvm.load_torch(compiled.export(tmp_path / "convnet.so"))
    torch.testing.assert_close(loaded(x), compiled(x))
    with pytest.raises(UnsupportedShapeError, match="compiled for"):
        loaded(torch.randn(1, 3, 32, 32))


def test_clear_errors_for_bad_inputs(convnet) -> None:
    _, x, compiled = convnet
    with pytest.raises(UnsupportedShapeError, match="dtype torch.float64"):
        compiled(x.double())
    with pytest.raises(UnsupportedShapeError, match="expected a torch.Tensor"):
        compiled(x.numpy())


def test_dynamic_dims_compile_per_size_within_bounds() -> None:
    model = _convnet()
    batch = torch.export.Dim("batch", min=1, max=4)
    compiled = tpp_tvm.compile_torch(model, (torch.randn(2, 3, 32, 32),),
                                     dynamic_shapes={"x": {0: batch}})
    for n in (3, 1):
        x = torch.randn(n, 3, 32, 32)
        with torch.no_grad():
            _close(compiled(x), model(x))
    assert len(compiled.compiled_sizes) == 3
    with pytest.raises(UnsupportedShapeError, match="'batch' = 5 .* outside its bounds"):
        compiled(torch.randn(5, 3, 32, 32))


def test_bf16_through_the_same_door() -> None:
    model, x = _convnet(), torch.randn(2, 3, 32, 32)
    compiled = tpp_tvm.compile_torch(model, (x,), precision="bf16")
    with torch.no_grad():
        _close(compiled(x), model(x), tol=3e-2)
    assert any("bf16" in k for k in compiled.report_data["lowered"]), compiled.report()


class Branchy(torch.nn.Module):
    """A graph break: a Python ``if`` on a tensor's value, and a print."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 64), torch.nn.Linear(64, 16)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.a(x))
        if h.sum() > 0:
            print("positive")
            h = h * 2
        return self.b(h)


def test_torch_compile_backend_with_a_graph_break(capsys) -> None:
    torch.manual_seed(0)
    model = Branchy().eval()
    compiled = torch.compile(model, backend="tpp_tvm")
    for seed in (1, 2):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("error", message="tpp_tvm")  # no graph falls back
            got = compiled(x)
            want = model(x)
        _close(got, want)
    torch._dynamo.reset()


def test_torch_compile_backend_options_and_eager_fallback() -> None:
    torch.manual_seed(0)
    model = ConvNet().eval()
    compiled = torch.compile(model, backend="tpp_tvm", options={"threads": 1})
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        _close(compiled(x), model(x))
    # Gradients: the backend compiles inference; this graph runs in eager, with a warning.
    train = torch.compile(torch.nn.Linear(8, 4), backend="tpp_tvm")
    with pytest.warns(UserWarning, match="tpp_tvm: running a graph in eager: the graph "
                                         "needs gradients"):
        out = train(torch.randn(2, 8))
    out.sum().backward()
    with pytest.raises(Exception, match="unknown options"):
        torch.compile(torch.nn.Linear(8, 4), backend="tpp_tvm",
                      options={"bogus": 1})(torch.randn(2, 8))
    torch._dynamo.reset()


class WithRareOps(torch.nn.Module):
    """A convolution and dense layers around operators TVM's importer lacks (digamma,
    kthvalue: a two-output operator)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.a = torch.nn.Linear(16, 64)
        self.b = torch.nn.Linear(64, 10)

    def forward(self, x):
        h = self.conv(x).relu()
        h = torch.digamma(h + 1.0)
        h = torch.kthvalue(h.flatten(2), 3, dim=-1)[0]
        return self.b(torch.nn.functional.gelu(self.a(h)))


def test_operators_the_import_lacks_run_in_eager_between_compiled_parts() -> None:
    """The graph is not given up to eager whole: the convolution and the dense layers run
    on TPP kernels in compiled parts, digamma and kthvalue in eager between them, with
    one warning naming them; the result matches eager."""
    from tpp_tvm.torch_partition import partition

    torch.manual_seed(0)
    model = WithRareOps().eval()
    compiled = torch.compile(model, backend="tpp_tvm", options={"threads": 1})
    x = torch.randn(2, 3, 12, 12)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = compiled(x)
        _close(compiled(x), model(x))
    messages = [str(w.message) for w in caught if "tpp_tvm" in str(w.message)]
    assert len(messages) == 1 and "digamma.default" in messages[0] \
        and "kthvalue.default" in messages[0] and "in eager" in messages[0], messages
    assert "running a graph in eager" not in messages[0]
    _close(got, model(x))
    torch._dynamo.reset()
    # The split itself: which operators stay in eager, and the kernels the parts run on.
    graph = partition(model, [x], {"threads": 1})
    assert graph.unsupported == {"digamma.default": 1, "kthvalue.default": 1}, \
        graph.eager_operators
    kernels = {row["pattern"] for part in graph.parts for row in part.report_data["kernels"]}
    assert any("conv2d" in k for k in kernels) and any("dense" in k for k in kernels), kernels
    with torch.no_grad():
        _close(graph(x), model(x))


def test_backend_is_registered_by_entry_point() -> None:
    from torch._dynamo import list_backends

    assert "tpp_tvm" in list_backends()


def test_values_stay_numpy_compatible() -> None:
    """Outputs share memory with TVM's (DLPack): writable torch tensors, right values."""
    model, x = _convnet(), torch.randn(1, 3, 32, 32)
    out = tpp_tvm.compile_torch(model, (x,))(x)
    out += 1
    assert np.isfinite(out.numpy()).all()


def test_attention_through_sdpa_reaches_the_attention_kernel() -> None:
    """torch's scaled_dot_product_attention (a boolean padding mask, causal, grouped-query
    heads) runs on the attention kernel, not as matmuls and a softmax."""

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.ModuleList(torch.nn.Linear(64, n) for n in (64, 32, 32) * 2)

        def heads(self, x, k: int, n: int):
            b, s, _ = x.shape
            return self.proj[k](x).view(b, s, n, 16).transpose(1, 2)

        def forward(self, x, keep):
            sdpa = torch.nn.functional.scaled_dot_product_attention
            q, k, v = self.heads(x, 0, 4), self.heads(x, 1, 2), self.heads(x, 2, 2)
            padded = sdpa(q, k, v, attn_mask=keep[:, None, None, :], enable_gqa=True)
            q, k, v = self.heads(x, 3, 4), self.heads(x, 4, 2), self.heads(x, 5, 2)
            causal = sdpa(q, k, v, is_causal=True, enable_gqa=True)
            return (padded + causal).transpose(1, 2).flatten(2)

    torch.manual_seed(0)
    model = Attention().eval()
    x = torch.randn(2, 12, 64)
    keep = torch.ones(2, 12, dtype=torch.bool)
    keep[1, 9:] = False
    compiled = tpp_tvm.compile_torch(model, (x, keep))
    with torch.no_grad():
        _close(compiled(x, keep), model(x, keep))
    lowered = compiled.report_data["lowered"]
    assert sum(n for k, n in lowered.items() if k.startswith("tpp.attention")) == 2, \
        compiled.report()
    assert not any(k in lowered for k in ("tpp.bmm", "tpp.softmax")), compiled.report()


def test_eager_attention_through_torch_matmul_reaches_the_attention_kernel(tmp_path) -> None:
    """Attention written with ``torch.matmul`` (transformers' eager attention: export
    decomposes it to views around ``bmm``) and a mask a traced model computes that masks
    nothing runs on the attention kernel, as the ONNX export of the same module does."""

    class EagerAttention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(64, 192)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, 4, 16).permute(2, 0, 3, 1, 4)
            keep = (torch.arange(s) >= 0)[None, None, None, :].expand(b, 1, s, s)
            mask = torch.where(keep, torch.tensor(0.0), torch.tensor(torch.finfo(x.dtype).min))
            scores = torch.matmul(q, k.transpose(2, 3)) * 0.25 + mask
            out = torch.matmul(torch.softmax(scores, dim=-1), v)
            return out.transpose(1, 2).reshape(b, s, 64)

    torch.manual_seed(0)
    model, x = EagerAttention().eval(), torch.randn(1, 24, 64)
    compiled = tpp_tvm.compile_torch(model, (x,))
    with torch.no_grad():
        _close(compiled(x), model(x))
    lowered = compiled.report_data["lowered"]
    assert sum(n for k, n in lowered.items() if k.startswith("tpp.attention")) == 1, \
        compiled.report()
    assert not any(k in lowered for k in ("tpp.bmm", "tpp.softmax")), compiled.report()


class RowBlocks(torch.nn.Module):
    """ConvNeXt's block tail (``Linear`` on NHWC rows, a layer scale, the NCHW residual)
    and Llama's SwiGLU MLP: torch's ``Linear`` views rows around each GEMM."""

    def __init__(self) -> None:
        super().__init__()
        self.pw = torch.nn.Linear(16, 16)
        self.gamma = torch.nn.Parameter(torch.rand(16) + 0.5)
        self.gate, self.up = torch.nn.Linear(16, 32, bias=False), torch.nn.Linear(16, 32,
                                                                                   bias=False)
        self.down = torch.nn.Linear(32, 16, bias=False)

    def forward(self, x):
        y = x + (self.gamma * self.pw(x.permute(0, 2, 3, 1))).permute(0, 3, 1, 2)
        rows = y.flatten(2).transpose(1, 2)
        act = torch.nn.functional.silu(self.gate(rows)) * self.up(rows)
        return rows + self.down(act)


def test_row_views_around_linears_fuse_as_in_the_onnx_route(tmp_path) -> None:
    """The layer scale folds into the weights, the residual and the SwiGLU gate join the
    GEMMs' epilogues through the views torch puts around a ``Linear``: the same kernels
    as the ONNX export of the module."""
    torch.manual_seed(0)
    compiled, onnx_lowered = _both_routes(RowBlocks().eval(), torch.randn(1, 16, 6, 6),
                                          tmp_path)
    lowered = compiled.report_data["lowered"]
    assert lowered == onnx_lowered, compiled.report()
    assert any("gate" in k for k in lowered) and any("residual" in k for k in lowered), \
        compiled.report()


def test_hardswish_and_hardsigmoid_as_torch_writes_them_fuse_like_onnx(tmp_path) -> None:
    class Mobile(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c = torch.nn.Conv2d(8, 16, 1)
            self.se = torch.nn.Conv2d(16, 16, 1)

        def forward(self, x):
            h = torch.nn.functional.hardswish(self.c(x))
            gate = torch.nn.functional.hardsigmoid(self.se(h.mean((2, 3), keepdim=True)))
            return torch.nn.functional.relu6(h * gate)

    torch.manual_seed(0)
    compiled, onnx_lowered = _both_routes(Mobile().eval(), torch.randn(1, 8, 14, 14), tmp_path)
    assert "tpp.conv2d_bias_hardswish" in compiled.report_data["lowered"], compiled.report()
    assert compiled.report_data["lowered"] == onnx_lowered


def test_pt2e_int8_model_runs_on_the_int8_kernels() -> None:
    """A model quantized with torchao's PT2E flow (X86 inductor quantizer: u8 activations,
    per-channel s8 weights) imports as QDQ and runs on the int8 TPPs, as ONNX QDQ does."""
    pt2e = pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e",
                               reason="PT2E quantization needs torchao")
    x86 = pytest.importorskip("torchao.quantization.pt2e.quantizer.x86_inductor_quantizer",
                              reason="PT2E quantization needs torchao")
    model, x = _convnet(), torch.randn(2, 3, 32, 32)
    captured = torch.export.export(model, (x,)).module()
    quantizer = x86.X86InductorQuantizer().set_global(
        x86.get_default_x86_inductor_quantization_config())
    prepared = pt2e.prepare_pt2e(captured, quantizer)
    for seed in range(4):
        prepared(torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(seed)))
    quantized = pt2e.convert_pt2e(prepared)
    compiled = tpp_tvm.compile_torch(quantized, (x,))
    with torch.no_grad():
        _close(compiled(x), quantized(x), tol=1e-3)
    lowered = compiled.report_data["lowered"]
    from tpp_tvm.schedules.gemm_plan import int8_gemm_dtype
    from tpp_tvm.target import best_isa

    kernels = sum(n for k, n in lowered.items() if k.startswith("tpp.qdq_"))
    assert kernels == (3 if int8_gemm_dtype(best_isa()) else 0), compiled.report()


def test_unaligned_and_strided_inputs(convnet) -> None:
    """A view at an odd offset or with strides is copied (TVM takes 64-byte aligned data)."""
    model, x, compiled = convnet
    base = torch.randn(x.numel() + 1)
    shifted = base[1:].view(x.shape)
    assert shifted.data_ptr() % 64
    with torch.no_grad():
        _close(compiled(shifted), model(shifted))
        wide = torch.randn(2, 3, 32, 64)[..., ::2]
        _close(compiled(wide), model(wide))


def test_cat_with_an_empty_vector_as_kv_caches_start() -> None:
    """torch.cat takes an empty 1-D tensor beside tensors of any rank (transformers' KV
    caches start from one); the import drops it instead of failing on the ranks."""

    class Cache(torch.nn.Module):
        def forward(self, k):
            return torch.cat([torch.tensor([]), k * 2.0], dim=-2)

    k = torch.randn(1, 2, 5, 8)
    compiled = tpp_tvm.compile_torch(Cache().eval(), (k,))
    torch.testing.assert_close(compiled(k), k * 2.0)
