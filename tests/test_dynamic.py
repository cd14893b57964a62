"""Dynamic shapes: exports with dynamic axes (``torch.onnx.export(dynamic_axes=...)``) of
real transformers architectures compile at the static sizes ``shape_dict`` gives, and as a
:class:`~tpp_tvm.dynamic.DynamicModel` (one build per size, bounded, cached, exported) they
run any size like ONNX Runtime.

transformers builds its attention masks from shape arithmetic (``Shape``/``Range``/``Where``
chains feeding an ``Expand``) and boolean ops; both must fold or build. Tiny configs, random
weights from a fixed seed, exported once per module.
"""

from __future__ import annotations

import numpy as np
import pytest

import tpp_tvm
from tpp_tvm import cli
from tpp_tvm import onnxruntime_ref as ort_ref
from tpp_tvm.dynamic import DynamicModel
from tpp_tvm.errors import UnsupportedShapeError

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

AXES = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
        "out": {0: "batch", 1: "seq"}}


def _export(tmp_path_factory, config, cls, name: str) -> str:
    torch.manual_seed(0)
    model = cls(config).eval()

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids, mask):
            return self.model(input_ids=ids, attention_mask=mask)[0]

    ids = torch.randint(0, config.vocab_size, (1, 8))
    mask = torch.ones(1, 8, dtype=torch.int64)
    path = str(tmp_path_factory.mktemp("dyn") / f"{name}.onnx")
    with torch.no_grad():
        torch.onnx.export(Wrapped(), (ids, mask), path, opset_version=17, dynamo=False,
                          input_names=["input_ids", "attention_mask"], output_names=["out"],
                          dynamic_axes=AXES)
    return path


@pytest.fixture(scope="module")
def distilbert(tmp_path_factory) -> str:
    config = transformers.DistilBertConfig(n_layers=1, dim=64, hidden_dim=128, n_heads=2,
                                           vocab_size=100, max_position_embeddings=64)
    return _export(tmp_path_factory, config, transformers.DistilBertModel, "distilbert")


@pytest.mark.parametrize(("batch", "seq"), [(1, 16), (2, 13)])
def test_dynamic_distilbert_export_compiles_and_masks(distilbert: str, batch: int,
                                                      seq: int) -> None:
    """The export TVM's converter rejected ("Cannot use and / or / not operator to Expr" on
    its mask ``Expand``, from a ``Shape`` of a value whose dims stayed unknown after
    folding), then the build ("dtype mismatch on BufferStore" on a vectorized bool mask):
    now it runs at any size given, with a padding mask, like ONNX Runtime."""
    rng = np.random.default_rng(batch * 100 + seq)
    mask = np.ones((batch, seq), np.int64)
    mask[:, seq - 3:] = 0
    feeds = {"input_ids": rng.integers(0, 100, (batch, seq)).astype(np.int64),
             "attention_mask": mask}
    compiled = tpp_tvm.compile_onnx(distilbert, shape_dict={k: v.shape for k, v in
                                                            feeds.items()})
    want = ort_ref.run_onnxruntime(distilbert, feeds)[0]
    got = compiled(**feeds)[0]
    assert got.shape == (batch, seq, 64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def _feeds(batch: int, seq: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(batch * 1000 + seq)
    mask = np.ones((batch, seq), np.int64)
    mask[:, seq - 2:] = 0
    return {"input_ids": rng.integers(0, 100, (batch, seq)).astype(np.int64),
            "attention_mask": mask}


def test_dynamic_model_runs_every_size_within_bounds(distilbert: str, tmp_path) -> None:
    """compile_onnx keeps the export's dynamic axes: sizes compile on first use, are
    cached (least recently used dropped past max_cached), checked against the bounds, and
    exported/loaded with the compiled sizes; results match ONNX Runtime at every size."""
    model = tpp_tvm.compile_onnx(distilbert, dynamic={"seq": (1, 32)}, max_cached=2)
    assert isinstance(model, DynamicModel) and model.dims == ["batch", "seq"]
    assert "Compiled sizes: none yet" in model.report()
    for batch, seq in [(1, 7), (3, 32), (1, 7)]:
        feeds = _feeds(batch, seq)
        want = ort_ref.run_onnxruntime(distilbert, feeds)[0]
        np.testing.assert_allclose(model(**feeds)[0], want, rtol=1e-4, atol=1e-4)
    assert model.compiled_sizes == [{"batch": 3, "seq": 32}, {"batch": 1, "seq": 7}]
    model.prepare(batch=2, seq=5)  # a third size: the least recently used one goes
    assert model.compiled_sizes == [{"batch": 1, "seq": 7}, {"batch": 2, "seq": 5}]
    report = model.report()
    assert "seq in [1, 32]: input_ids[1], attention_mask[1]" in report
    assert "batch in [1, inf)" in report and "TPP kernels:" in report
    with pytest.raises(UnsupportedShapeError, match=r"'seq' = 33 .* outside its bounds \[1, 32\]"):
        model(**_feeds(1, 33))
    bad = _feeds(1, 8)
    bad["attention_mask"] = bad["attention_mask"][:, :6]
    with pytest.raises(UnsupportedShapeError, match="'seq' is 8 in input 'input_ids' dim 1 "
                                                     "but 6 in input 'attention_mask'"):
        model(**bad)
    with pytest.raises(UnsupportedShapeError, match="not dynamic dimensions"):
        tpp_tvm.compile_onnx(distilbert, dynamic={"sequence": (1, 8)})

    loaded = tpp_tvm.load(model.export(tmp_path / "dyn"))
    assert loaded.compiled_sizes == model.compiled_sizes and loaded.bounds == model.bounds
    feeds = _feeds(2, 5)
    np.testing.assert_array_equal(loaded(**feeds)[0], model(**feeds)[0])
    assert len(loaded.compiled_sizes) == 2  # served by the exported build, nothing compiled


def test_dynamic_model_over_the_protobuf_limit_exports_its_weights_beside_it(
        distilbert: str, tmp_path, monkeypatch) -> None:
    """A dynamic LLM export is over protobuf's 2 GiB (here: over a limit lowered to 1 kB):
    the exported folder keeps its weights as ONNX external data (``onnx.save`` raised), and
    the loaded model compiles a new size from them."""
    from tpp_tvm import frontend

    monkeypatch.setattr(frontend.loading, "_PROTOBUF_LIMIT", 1000)
    folder = tpp_tvm.compile_onnx(distilbert).export(tmp_path / "dyn")
    assert (folder / "model.onnx.data").stat().st_size > 0
    feeds = _feeds(1, 6)
    np.testing.assert_allclose(tpp_tvm.load(folder)(**feeds)[0],
                               ort_ref.run_onnxruntime(distilbert, feeds)[0],
                               rtol=1e-4, atol=1e-4)


def test_shape_dict_marks_dims_dynamic_and_fixes_others(distilbert: str) -> None:
    model = tpp_tvm.compile_onnx(distilbert, shape_dict={"input_ids": (1, None),
                                                         "attention_mask": (1, None)})
    assert model.dims == ["seq"]
    with pytest.raises(UnsupportedShapeError, match="dim 0: 2, the model fixes it to 1"):
        model(**_feeds(2, 4))


def test_cli_marks_dims_dynamic_and_runs_a_size(distilbert: str, tmp_path, capsys) -> None:
    assert cli._parse_shapes("ids=1x?,mask=1x?") == {"ids": (1, None), "mask": (1, None)}
    assert cli._parse_bounds("seq=1:512,batch=1:8") == {"seq": (1, 512), "batch": (1, 8)}
    out = tmp_path / "dyn"
    assert cli.main(["compile", distilbert, "-o", str(out), "--dynamic", "seq=1:16",
                     "--prepare", "input_ids=1x4,attention_mask=1x4"]) == 0
    assert "with 1 size(s) compiled" in capsys.readouterr().out
    assert cli.main(["run", str(out), "--shape", "input_ids=1x4,attention_mask=1x4"]) == 0
    assert "compiling size" not in capsys.readouterr().out  # exported with the model
    assert cli.main(["run", str(out), "--shape", "input_ids=2x9,attention_mask=2x9"]) == 0
    printed = capsys.readouterr().out
    assert "compiling size batch=2, seq=9" in printed and "output 0: float32 (2, 9, 64)" in printed
    assert cli.main(["run", str(out), "--shape", "input_ids=1x17,attention_mask=1x17"]) == 2
    assert "outside its bounds [1, 16]" in capsys.readouterr().err


def test_concurrent_calls_compile_each_size_once(distilbert: str) -> None:
    """Threads asking for sizes at once: each size compiles once, every result is right."""
    import threading

    model = tpp_tvm.compile_onnx(distilbert, dynamic={"seq": (1, 32)})
    sizes = [(1, 7), (2, 5), (1, 7), (2, 5)]
    results: dict[int, np.ndarray] = {}

    def work(k: int) -> None:
        results[k] = model(**_feeds(*sizes[k]))[0]

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(sizes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(map(str, model.compiled_sizes)) == sorted(
        {str({"batch": b, "seq": s}) for b, s in sizes})
    for k, (batch, seq) in enumerate(sizes):
        want = ort_ref.run_onnxruntime(distilbert, _feeds(batch, seq))[0]
        np.testing.assert_allclose(results[k], want, rtol=1e-4, atol=1e-4)
