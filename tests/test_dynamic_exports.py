"""Exports with dynamic axes (``torch.onnx.export(dynamic_axes=...)``) of real transformers
architectures compile at the static sizes ``shape_dict`` gives, and match ONNX Runtime.

transformers builds its attention masks from shape arithmetic (``Shape``/``Range``/``Where``
chains feeding an ``Expand``) and boolean ops; both must fold or build. Tiny configs, random
weights from a fixed seed, exported once per session.
"""

from __future__ import annotations

import numpy as np
import pytest

import tpp_tvm
from tpp_tvm import onnxruntime_ref as ort_ref

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
