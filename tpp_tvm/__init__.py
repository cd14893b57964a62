"""tpp_tvm: LIBXSMM's Tensor Processing Primitives as TVM tensor intrinsics, for fast CPU DL.

The public API is small:

* :func:`target` – the TPP target for this host (or a named ISA);
* :func:`compile_onnx` / :func:`load` – an ONNX model compiled onto TPPs, callable with numpy;
* :func:`compile_torch` / :func:`load_torch` – a PyTorch module compiled onto the same kernels,
  callable with torch tensors; ``torch.compile(model, backend="tpp_tvm")`` for dynamo;
* :class:`DecoderSession` – token-by-token decoding of a causal LM exported with its KV cache
  (``tpp_tvm.cache_export``);
* :func:`build` – a Relax module through the ``tpp`` pipeline (``relay.build``'s successor);
* :func:`from_onnx` – robust ONNX import into Relax;
* :func:`build_gemm` – one GEMM (+bias, +activation) compiled onto TPPs;
* :func:`tune` – MetaSchedule tuning with the TPP rules, into a tuning log ``build`` and
  ``compile_onnx`` apply;
* :func:`registered` – the TPP tensor intrinsics; :class:`TPPError` – errors users can hit;
* :func:`custom_op` – a new operator from a TE expression, gradient derived (training);
  ``tpp_tvm.training.compile_training_step`` compiles whole training steps.

Importing the module does not import the ``target`` submodule name over the function:
use ``tpp_tvm.target()`` for the target and ``tpp_tvm.target_info`` for host detection.
"""

from . import target as target_info
from . import tir_pipeline  # noqa: F401 - registers the "tpp" TIR pipeline
from .compiled import CompiledModel, compile_onnx, compile_relax, load
from .decoding import DecoderSession
from .errors import TPPError
from .frontend import from_onnx
from .intrinsics import registered
from .kernels import build_gemm
from .relay_passes import build
from .target import host_isa, target
from .torch_model import TorchModel, compile_torch, load_torch
from .tuning.driver import tune


def custom_op(name: str, fcompute):  # noqa: ANN201 - returns training.custom_op.CustomOp
    """A new operator from a TE expression with a derived gradient (see
    ``tpp_tvm.training.custom_op``). Imported lazily: training registers gradients."""
    from .training.custom_op import custom_op as make

    return make(name, fcompute)


__all__ = [
    "CompiledModel",
    "DecoderSession",
    "TPPError",
    "TorchModel",
    "build",
    "build_gemm",
    "compile_onnx",
    "compile_relax",
    "compile_torch",
    "custom_op",
    "from_onnx",
    "host_isa",
    "load",
    "load_torch",
    "registered",
    "target",
    "target_info",
    "tune",
]
__version__ = "0.1.0"
