"""What the benchmarks share: timing, worker processes, the machine line and result files.

Every benchmark measures each (implementation, thread count) in a worker process of its own
(thread pools are sized once per process: TVM's from ``TVM_NUM_THREADS`` at its first
parallel call, OpenMP's and OpenBLAS's at load), times calls the same way, and writes
``<name>.json`` and ``<name>.md`` with the same header. Those parts live here; each
benchmark keeps its workloads, adapters and tables.

A result measured on one CPU says nothing about another, so each CPU model gets its own
folder under ``benchmarks/results/``, named as its tuning logs are (``<isa>-<mcpu>``:
``avx512-znver5``, ``amx-emeraldrapids``); a run on another machine adds a folder instead of
overwriting this one's tables.

Benchmarks import ``tpp_tvm`` as installed (``pip install -e .`` in a checkout, or
``PYTHONPATH`` to measure another tree; workers inherit the environment) and this module as
a sibling: run them as scripts (``python benchmarks/gemm.py``), which puts this folder on
``sys.path``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def keep_fastest(rows: list[dict], keys: tuple[str, ...], time_field: str) -> list[dict]:
    """One row per ``keys`` value: the pass with the lowest ``time_field``. Benchmarks with
    ``--passes`` alternate their workers and keep each one's fastest pass, because this
    machine's speed drifts by tens of percent over minutes (a row that failed in one pass
    and ran in another keeps the run)."""
    best: dict[tuple, dict] = {}
    for row in rows:
        key = tuple(row.get(k) for k in keys)
        old = best.get(key)
        if old is None or (row.get(time_field) or math.inf) < (old.get(time_field) or math.inf):
            best[key] = row
    return list(best.values())


def results_dir() -> Path:
    """``benchmarks/results/<isa>-<mcpu>`` of this host's default TPP target."""
    import tpp_tvm
    from tpp_tvm.tuning import target_tag

    return RESULTS / target_tag(tpp_tvm.target())


# ----------------------------------------------------------------------------- timing


@dataclass
class Timing:
    """How hard to time: each repeat lasts >= min_repeat_s; at most max_total_s per case."""

    repeat: int = 7
    min_repeat_s: float = 0.1
    max_total_s: float = 3.0


TIMING = Timing()
QUICK_TIMING = Timing(repeat=3, min_repeat_s=0.02, max_total_s=1.0)


def use_quick_timing() -> None:
    """Time with :data:`QUICK_TIMING` from now on in this process (``--quick`` runs)."""
    TIMING.__dict__.update(QUICK_TIMING.__dict__)


def timing_plan(call_s: float) -> tuple[int, int]:
    """(number, repeat) for a call taking about ``call_s`` seconds, within :data:`TIMING`."""
    number = max(1, math.ceil(TIMING.min_repeat_s / max(call_s, 1e-9)))
    repeat = max(1, min(TIMING.repeat, int(TIMING.max_total_s / max(call_s * number, 1e-9))))
    return number, repeat


def median_time(fn: Callable[[], Any]) -> float:
    """Median seconds per call of ``fn`` (already warmed up by the caller): a median of
    repeats, since other work on a shared machine only ever adds time."""
    t0 = time.perf_counter()
    fn()
    number, repeat = timing_plan(time.perf_counter() - t0)
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - t0) / number)
    return statistics.median(samples)


class Skipped(Exception):
    """An adapter declines a case on purpose (the message says why)."""


def untuned_tvm_matmul(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, float, str]:
    """``a @ b`` as a TE matmul compiled by TVM with no schedule (what TVM does without
    tpp_tvm; serial code): (result, median seconds per call, the LLVM mcpu used)."""
    import tvm
    from tvm import te
    from tvm.target import codegen

    (m, k), n = a.shape, b.shape[1]
    a_ph = te.placeholder((m, k), "float32", name="A")
    b_ph = te.placeholder((k, n), "float32", name="B")
    r = te.reduce_axis((0, k), name="k")
    c_ph = te.compute((m, n), lambda i, j: te.sum(a_ph[i, r] * b_ph[r, j], axis=r), name="C")
    mcpu = str(codegen.llvm_get_system_cpu())
    lib = tvm.compile(
        te.create_prim_func([a_ph, b_ph, c_ph]), target={"kind": "llvm", "mcpu": mcpu}
    )
    dev = tvm.cpu()
    a_t, b_t = tvm.runtime.tensor(a, dev), tvm.runtime.tensor(b, dev)
    c_t = tvm.runtime.tensor(np.zeros((m, n), np.float32), dev)
    lib(a_t, b_t, c_t)
    c = c_t.numpy()
    return c, median_time(lambda: lib(a_t, b_t, c_t)), mcpu


# ----------------------------------------------------------------------------- workers


def worker_env(threads: int, *, native_openblas: bool = False) -> dict[str, str]:
    """The environment of a worker running ``threads`` threads in every runtime.

    ``native_openblas``: drop site-wide overrides that pin OpenBLAS to Haswell kernels, so
    a numpy peer runs its best."""
    env = dict(os.environ)
    for var in ("TVM_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    if native_openblas:
        env.pop("OPENBLAS_CORETYPE", None)
        env.pop("OPENBLAS_L2_SIZE", None)
    return env


def worker_rows(cmd: list[str], env: dict, timeout: float) -> tuple[list | None, str]:
    """Run a benchmark worker process; (its JSON rows, "") or (None, why it gave none)."""
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode == 0:
            return json.loads(proc.stdout.strip().splitlines()[-1]), ""
        why = f"worker exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"
    except subprocess.TimeoutExpired:
        why = f"worker timed out after {timeout} s"
    except (json.JSONDecodeError, IndexError) as exc:
        why = f"worker printed no JSON: {exc}"
    return None, why


# ----------------------------------------------------------------------------- results


def measure_peaks(threads: list[int], instr: str = "fp32_fma") -> dict[int, float]:
    """The measured peak of ``instr`` (``benchmarks/peak.py``) per thread count."""
    from peak import measure_peak

    return {t: measure_peak(instr, t) for t in threads}


def measure_read_bandwidth(threads: int, repeats: int = 2) -> float:
    """The measured memory read bandwidth in GB/s (``benchmarks/peak.py --stream read``)."""
    from peak import measure_bandwidth

    return measure_bandwidth("read", threads, repeats=repeats)


def machine() -> str:
    """lscpu's model name plus what tpp_tvm detects (ISA, caches, cores)."""
    name = "unknown CPU"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                name = line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    try:
        from tpp_tvm.target import host_isa

        return f"{name} ({host_isa().summary()})"
    except Exception as exc:  # the header must not kill the benchmark
        return f"{name} (ISA detection failed: {exc})"


def run_header(machine_line: str, date: str, command: str, load: str) -> list[str]:
    """The markdown bullet lines every results table starts with."""
    return [
        f"- Machine: {machine_line}",
        f"- Date: {date}",
        f"- Command: `{command}`",
        f"- 1-minute load average before / after the run: {load} (other work on this machine "
        "depresses the numbers, the multi-threaded ones most)",
    ]


def write_results(out_dir: str, name: str, argv: list[str], rows: list[dict],
                  load_before: float, render: Callable[[str, str, str], str],
                  script: str | None = None) -> None:
    """Write ``<name>.json`` and ``<name>.md`` (header: command, date, load) and print the md.

    ``script`` names the benchmark file when it is not ``<name>.py``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(rows, indent=1) + "\n")
    command = shlex.join(["python", f"benchmarks/{script or name}.py", *argv])
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    load = f"{load_before:.2f} / {os.getloadavg()[0]:.2f}"
    md = render(command, date, load)
    (out / f"{name}.md").write_text(md)
    print(md)


# ---------------------------------------------------------------- the zoo's models
# The model zoo (``zoo.py``), its load benchmark (``load.py``) and its PyTorch benchmark
# (``torch_models.py``) run the same models, exports, compiled libraries and runtimes.

HERE = Path(__file__).resolve().parent
CACHE = Path(tempfile.gettempdir()) / "tpp_tvm_zoo"
IMPLS = ("tpp_tvm", "onnxruntime", "openvino", "torch")
#: In the int8 zoos, each peer also runs the unquantized export: a peer's figure is the
#: better of its int8 and its fp32 time (its int8 can be the slower, as ORT's dynamic
#: quantization of a CNN is), so tpp_tvm never gains from a peer's worst setting.
FP32_PEERS = {"onnxruntime_fp32": "onnxruntime", "openvino_fp32": "openvino"}
#: In the fp32 zoo, ONNX Runtime also runs its transformer optimizer's output (fused
#: attention, LayerNorm, GELU: ``onnxruntime.transformers.optimizer``) where it knows the
#: architecture; ORT's figure is the better of the two.
ORT_OPTIMIZED = {"onnxruntime_opt": "onnxruntime"}
#: The ORT transformer optimizer's model type of each zoo model it takes.
ORT_OPTIMIZER_TYPES = {"bert": "bert", "distilbert": "bert", "gpt2": "gpt2", "vit": "vit",
                       "swin": "swin", "wav2vec2": "bert", "clip_text": "clip",
                       "albert": "bert"}
IMPL_TITLES = {"tpp_tvm": "tpp_tvm", "onnxruntime": "ONNX Runtime", "openvino": "OpenVINO",
               "torch": "torch", "onnxruntime_fp32": "ONNX Runtime fp32",
               "openvino_fp32": "OpenVINO f32", "onnxruntime_opt": "ONNX Runtime optimized"}

#: Calibration samples of the static quantization (ORT's examples use a few dozen to a few
#: hundred; one sample gave ranges that made its int8 slower and less accurate).
CALIBRATION_SAMPLES = 32


@dataclass(frozen=True)
class ZooPrecision:
    """How ``--precision`` runs the zoo: tpp_tvm's precision, OpenVINO's precision hint
    (None: OpenVINO's default), the ONNX Runtime quantization the runtimes share (None: the
    fp32 export) and the results' file stem suffix."""

    tpp_tvm: str
    openvino_hint: str | None
    quantization: str | None
    suffix: str


PRECISIONS = {
    "float32": ZooPrecision("float32", "f32", None, ""),
    "bf16": ZooPrecision("bfloat16", "bf16", None, "_bf16"),
    "int8": ZooPrecision("float32", None, "qdq", "_int8"),
    "int8-dynamic": ZooPrecision("float32", None, "dynamic", "_int8_dynamic"),
}


def peer_alternates(precision: ZooPrecision) -> dict[str, str]:
    """The extra runs of each peer whose better figure counts (run -> peer)."""
    if precision.quantization:
        return FP32_PEERS
    return ORT_OPTIMIZED if precision.tpp_tvm == "float32" else {}


def ort_optimized(name: str) -> Path | None:
    """The fp32 export through ONNX Runtime's transformer optimizer (cached), or None for a
    model it has no type for."""
    kind = ORT_OPTIMIZER_TYPES.get(name)
    if kind is None:
        return None
    path = CACHE / f"{name}_ort_optimized.onnx"
    if not path.exists():
        from onnxruntime.transformers.optimizer import optimize_model

        optimized = optimize_model(str(export(ALL_MODELS[name])), model_type=kind,
                                   num_heads=0, hidden_size=0)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.onnx")
        optimized.save_model_to_file(str(tmp))
        tmp.replace(path)
    return path


@dataclass(frozen=True)
class ZooModel:
    name: str
    title: str
    build: Callable[[], object]  # the torch module (random weights)
    inputs: Callable[[np.random.Generator], dict[str, np.ndarray]]
    layers: str


def _text(seq: int = 128, vocab: int = 1000):
    def make(rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {"input_ids": rng.integers(0, vocab, (1, seq)).astype("int64")}
    return make


def _image(size: int = 224):
    def make(rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {"pixel_values": rng.standard_normal((1, 3, size, size)).astype("float32")}
    return make


def _audio(samples: int = 16000):
    def make(rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {"input_values": rng.standard_normal((1, samples)).astype("float32")}
    return make


def stub_torchvision_ops() -> None:
    """Empty modules under the two names that register the fakes of ``torchvision``'s C ops:
    the registry's wheel is a CUDA build whose ops do not load beside the CPU torch, so
    ``import torchvision`` (which ``transformers`` and ``timm`` do whenever it is installed)
    dies there; its pure-Python model code imports and runs without them."""
    for name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
        sys.modules.setdefault(name, types.ModuleType(name))


def _hf(config_name: str, model_name: str, **config) -> Callable[[], object]:
    def build():
        import torch

        stub_torchvision_ops()
        import transformers

        torch.manual_seed(0)
        cfg = getattr(transformers, config_name)(**config)
        cfg._attn_implementation = "eager"
        model = getattr(transformers, model_name)(cfg).eval()
        # Convolutions get He initialisation and batch norms unit scale: with the configs'
        # initializer_range (std 0.02, batch-norm scales too) a deep CNN's activations
        # vanish into denormal floats (EfficientNet-B0's output was all zeros, and every
        # runtime ran 25x slower on denormal arithmetic).
        for module in model.modules():
            if isinstance(module, (torch.nn.Conv1d, torch.nn.Conv2d)):
                torch.nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
            elif isinstance(module, torch.nn.BatchNorm2d):
                torch.nn.init.ones_(module.weight)
                torch.nn.init.zeros_(module.bias)
        return model
    return build


MODELS: dict[str, ZooModel] = {m.name: m for m in [
    ZooModel("bert", "BERT-base encoder", _hf("BertConfig", "BertModel", num_hidden_layers=4),
             _text(), "4 of 12"),
    ZooModel("distilbert", "DistilBERT", _hf("DistilBertConfig", "DistilBertModel", n_layers=4),
             _text(), "4 of 6"),
    ZooModel("gpt2", "GPT-2 (tanh-GELU)", _hf("GPT2Config", "GPT2Model", n_layer=4), _text(),
             "4 of 12"),
    ZooModel("llama", "Llama-style decoder (GQA 16/4, RMSNorm, SwiGLU, RoPE)",
             _hf("LlamaConfig", "LlamaModel", hidden_size=1024, intermediate_size=2816,
                 num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
                 vocab_size=1000), _text(), "4"),
    ZooModel("vit", "ViT-B/16", _hf("ViTConfig", "ViTModel", num_hidden_layers=4), _image(),
             "4 of 12"),
    ZooModel("swin", "Swin-T", _hf("SwinConfig", "SwinModel"), _image(), "all"),
    ZooModel("convnext", "ConvNeXt-T (7x7 depthwise, channel LayerNorm)",
             _hf("ConvNextConfig", "ConvNextModel"), _image(), "all"),
    ZooModel("resnet50", "ResNet-50", _hf("ResNetConfig", "ResNetModel"), _image(), "all"),
    ZooModel("mobilenet_v2", "MobileNetV2", _hf("MobileNetV2Config", "MobileNetV2Model"),
             _image(), "all"),
    ZooModel("efficientnet", "EfficientNet-B0", _hf("EfficientNetConfig", "EfficientNetModel",
                                                    width_coefficient=1.0, depth_coefficient=1.0,
                                                    image_size=224, hidden_dim=1280),
             _image(), "all"),
    ZooModel("regnet", "RegNetY-040 (grouped convs, squeeze-excite)",
             _hf("RegNetConfig", "RegNetModel"), _image(), "all"),
    ZooModel("wav2vec2", "wav2vec2 (1 s of 16 kHz audio)",
             _hf("Wav2Vec2Config", "Wav2Vec2Model", num_hidden_layers=4), _audio(), "4 of 12"),
]}


def _frames(frames: int, size: int = 224):
    def make(rng: np.random.Generator) -> dict[str, np.ndarray]:
        shape = (1, frames, 3, size, size)
        return {"pixel_values": rng.standard_normal(shape).astype("float32")}
    return make


def _features(name: str, *shape: int):
    def make(rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {name: rng.standard_normal((1, *shape)).astype("float32")}
    return make


def _encoder(build: Callable[[], object]) -> Callable[[], object]:
    """An encoder-decoder model's encoder (Whisper's)."""
    return lambda: build().get_encoder()


def _recurrent(kind: str) -> Callable[[], object]:
    """Two stacked torch LSTM/GRU layers (80 features -> 256) and a linear head: a speech
    or time-series model's recurrent core."""
    def build():
        import torch

        torch.manual_seed(0)

        class Recurrent(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.rnn = getattr(torch.nn, kind)(80, 256, num_layers=2, batch_first=True)
                self.head = torch.nn.Linear(256, 32)

            def forward(self, x):
                return (self.head(self.rnn(x)[0]),)

        return Recurrent().eval()
    return build


#: More architectures (``--set more``): operators and forms the first set does not have.
MORE_MODELS: dict[str, ZooModel] = {m.name: m for m in [
    ZooModel("clip_text", "CLIP text encoder (quick GELU, causal mask)",
             _hf("CLIPTextConfig", "CLIPTextModel", num_hidden_layers=4, vocab_size=1000),
             _text(77), "4 of 12"),
    ZooModel("albert", "ALBERT-base (shared layers)",
             _hf("AlbertConfig", "AlbertModel", hidden_size=768, num_attention_heads=12,
                 intermediate_size=3072, num_hidden_layers=4), _text(), "4 of 12"),
    ZooModel("funnel", "Funnel (pooled queries, einsum attention)",
             _hf("FunnelConfig", "FunnelBaseModel", block_sizes=[1, 1, 1], vocab_size=1000),
             _text(), "3 blocks of 1"),
    ZooModel("levit", "LeViT-128S (attention bias, d_v != d_k)",
             _hf("LevitConfig", "LevitModel"), _image(), "all"),
    ZooModel("cvt", "CvT-13 (depthwise-conv projections, einsum)",
             _hf("CvtConfig", "CvtModel"), _image(), "all"),
    ZooModel("mobilevit", "MobileViT-S (unfold by computed reshapes)",
             _hf("MobileViTConfig", "MobileViTModel"), _image(256), "all"),
    ZooModel("poolformer", "PoolFormer-S12 (3x3 average-pool token mixer)",
             _hf("PoolFormerConfig", "PoolFormerModel"), _image(), "all"),
    ZooModel("bit", "BiT-R50 (weight standardization, group norm)",
             _hf("BitConfig", "BitModel"), _image(), "all"),
    ZooModel("videomae", "VideoMAE (Conv3d tubelets, 8 frames)",
             _hf("VideoMAEConfig", "VideoMAEModel", num_hidden_layers=2, num_frames=8),
             _frames(8), "2 of 12"),
    ZooModel("ast", "Audio Spectrogram Transformer (overlapping patches)",
             _hf("ASTConfig", "ASTModel", num_hidden_layers=2),
             _features("input_values", 1024, 128), "2 of 12"),
    ZooModel("whisper", "Whisper encoder (30 s of log-mel)",
             _encoder(_hf("WhisperConfig", "WhisperModel", encoder_layers=2)),
             _features("input_features", 80, 3000), "2 of 4"),
    ZooModel("hubert", "HuBERT (1 s of 16 kHz audio)",
             _hf("HubertConfig", "HubertModel", num_hidden_layers=4), _audio(), "4 of 12"),
    ZooModel("lstm", "LSTM (2 layers, 80 -> 256, 100 steps)", _recurrent("LSTM"),
             _features("x", 100, 80), "2"),
    ZooModel("gru", "GRU (2 layers, 80 -> 256, 100 steps)", _recurrent("GRU"),
             _features("x", 100, 80), "2"),
]}
#: --- The breadth set (``--set breadth``) -------------------------------------------------
#: Image architectures from ``timm`` and ``torchvision`` that nothing in tpp_tvm was written
#: or tuned for, by family: mobile CNNs, re-parameterised CNNs, dense / inception /
#: split-attention CNNs, MLP-mixers, hybrid conv-attention models, hierarchical and
#: windowed vision transformers, segmentation heads. Random weights, batch 1, the model's
#: default input size. The registry's ``torchvision`` wheels are CUDA builds whose C ops do
#: not load beside the CPU torch, and ``import torchvision`` dies registering fakes for
#: them (``timm`` imports it): :func:`import_vision` puts empty modules under the two names
#: that register them first, and the pure-Python model code imports and runs.


def import_vision() -> tuple[types.ModuleType, types.ModuleType]:
    """``timm`` and ``torchvision``, importable beside the CPU torch (see above)."""
    stub_torchvision_ops()
    import timm
    import torchvision

    return timm, torchvision


@dataclass(frozen=True)
class Architecture:
    name: str
    family: str
    source: str  # "timm", "torchvision" or "torchvision.segmentation"
    size: int  # input pixels a side

    def build(self):
        """The torch module, random weights, eval mode."""
        import torch

        timm, torchvision = import_vision()
        torch.manual_seed(0)
        if self.source == "timm":
            # SDPA's export with a tensor is_causal fails (EVA-02): the explicit attention
            timm.layers.set_fused_attn(False)
            return _no_zero_weights(timm.create_model(self.name, pretrained=False).eval())
        if self.source == "torchvision.segmentation":
            return getattr(torchvision.models.segmentation, self.name)(
                weights=None, weights_backbone=None).eval()
        kwargs = {"init_weights": True} if self.name in ("googlenet", "inception_v3") else {}
        if self.name in ("googlenet", "inception_v3"):
            kwargs["aux_logits"] = False
        return getattr(torchvision.models, self.name)(weights=None, **kwargs).eval()


def _no_zero_weights(model):
    """``model`` with its all-zero weight matrices drawn at random: timm zero-initialises
    some heads (gMLP's), which makes every output 0 and no error measurable."""
    import torch

    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2 and not param.any():
                param.normal_(0.0, 0.02)
    return model


MOBILE, REPARAM, DENSE = "mobile CNN", "re-parameterised CNN", "dense/inception/split CNN"
MIXER, HYBRID, HIER, SEG = ("MLP-mixer", "hybrid conv-attention",
                            "hierarchical/windowed ViT", "segmentation head")

_TIMM = [
    # mobile CNNs
    ("mobilenetv3_large_100", MOBILE, 224), ("mobilenetv3_small_100", MOBILE, 224),
    ("ghostnet_100", MOBILE, 224), ("ghostnetv2_100", MOBILE, 224),
    ("mnasnet_100", MOBILE, 224), ("tf_efficientnet_lite0", MOBILE, 224),
    ("mixnet_s", MOBILE, 224), ("fbnetc_100", MOBILE, 224), ("lcnet_100", MOBILE, 224),
    ("tinynet_a", MOBILE, 192), ("rexnet_100", MOBILE, 224), ("hgnetv2_b0", MOBILE, 224),
    ("convnextv2_atto", MOBILE, 224),
    # re-parameterised CNNs
    ("mobileone_s0", REPARAM, 224), ("repvgg_a0", REPARAM, 224),
    ("repghostnet_100", REPARAM, 224), ("regnetx_002", REPARAM, 224),
    ("regnety_008", REPARAM, 224), ("gernet_s", REPARAM, 224),
    # dense / inception / split-attention CNNs
    ("xception41", DENSE, 299), ("inception_v4", DENSE, 299), ("densenet121", DENSE, 224),
    ("resnest14d", DENSE, 224), ("res2net50_14w_8s", DENSE, 224), ("dla34", DENSE, 224),
    ("dpn68", DENSE, 224), ("selecsls42b", DENSE, 224), ("hrnet_w18_small", DENSE, 224),
    ("cspresnet50", DENSE, 256), ("cspdarknet53", DENSE, 256),
    ("ese_vovnet19b_dw", DENSE, 224), ("nf_resnet26", DENSE, 224), ("skresnet18", DENSE, 224),
    # MLP-mixers
    ("mixer_b16_224", MIXER, 224), ("resmlp_12_224", MIXER, 224), ("gmlp_s16_224", MIXER, 224),
    ("convmixer_768_32", MIXER, 224),
    # hybrid conv-attention
    ("fastvit_t8", HYBRID, 256), ("coat_lite_tiny", HYBRID, 224), ("levit_128s", HYBRID, 224),
    ("mobilevit_s", HYBRID, 256), ("efficientformer_l1", HYBRID, 224),
    ("efficientformerv2_s0", HYBRID, 224), ("edgenext_x_small", HYBRID, 256),
    ("poolformerv2_s12", HYBRID, 224), ("convit_tiny", HYBRID, 224),
    ("coatnet_0_rw_224", HYBRID, 224), ("maxvit_tiny_tf_224", HYBRID, 224),
    ("tiny_vit_5m_224", HYBRID, 224), ("inception_next_tiny", HYBRID, 224),
    # hierarchical and windowed vision transformers
    ("swin_tiny_patch4_window7_224", HIER, 224), ("swinv2_cr_tiny_ns_224", HIER, 224),
    ("pvt_v2_b0", HIER, 224), ("twins_svt_small", HIER, 224), ("pit_ti_224", HIER, 224),
    ("deit_tiny_patch16_224", HIER, 224), ("vit_small_patch16_224", HIER, 224),
    ("eva02_tiny_patch14_224", HIER, 224), ("focalnet_tiny_srf", HIER, 224),
    ("davit_tiny", HIER, 224), ("xcit_tiny_12_p16_224", HIER, 224),
    ("gcvit_xxtiny", HIER, 224), ("nest_tiny", HIER, 224), ("cait_xxs24_224", HIER, 224),
    ("crossvit_tiny_240", HIER, 240),
]
_TORCHVISION = [
    ("shufflenet_v2_x1_0", MOBILE, 224), ("mobilenet_v3_small", MOBILE, 224),
    ("mnasnet0_5", MOBILE, 224), ("squeezenet1_1", MOBILE, 224),
    ("googlenet", DENSE, 224), ("inception_v3", DENSE, 299), ("resnext50_32x4d", DENSE, 224),
    ("regnet_y_400mf", REPARAM, 224), ("vgg16", DENSE, 224), ("alexnet", DENSE, 224),
]
_SEGMENTATION = [
    ("deeplabv3_mobilenet_v3_large", SEG, 224), ("lraspp_mobilenet_v3_large", SEG, 224),
    ("fcn_resnet50", SEG, 224),
]

ARCHITECTURES: dict[str, Architecture] = {
    **{n: Architecture(n, f, "timm", s) for n, f, s in _TIMM},
    **{f"tv_{n}": Architecture(n, f, "torchvision", s) for n, f, s in _TORCHVISION},
    **{f"tv_{n}": Architecture(n, f, "torchvision.segmentation", s) for n, f, s in _SEGMENTATION},
}


BREADTH_MODELS: dict[str, ZooModel] = {
    key: ZooModel(key, f"{a.name} ({a.source.split('.')[0]}, {a.family})", a.build,
                  _image(a.size), "all")
    for key, a in ARCHITECTURES.items()}
SETS = {"main": MODELS, "more": MORE_MODELS, "breadth": BREADTH_MODELS}
ALL_MODELS = {**MODELS, **MORE_MODELS, **BREADTH_MODELS}
#: Largest max |tpp_tvm - ORT| / max |ORT| of a correct fp32 row: a row above it is marked
#: wrong, left out of the means, and the run exits non-zero.
FP32_TOLERANCE = 1e-4


class FirstOutput:
    """A torch module returning only its first output tensor (ONNX export, torch runs)."""

    def __new__(cls, module):
        import torch

        class Wrapped(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = module

            def forward(self, *args):
                out = self.inner(*args)
                if isinstance(out, torch.Tensor):
                    return out
                if isinstance(out, (tuple, list)):
                    return out[0]
                if isinstance(out, dict) and "last_hidden_state" not in out:
                    return next(iter(out.values()))  # torchvision segmentation: "out"
                return out.last_hidden_state

        return Wrapped().eval()


def onnx_path(name: str) -> Path:
    return CACHE / f"{name}.onnx"


def export(model: ZooModel) -> Path:
    """The model's ONNX file (exported once into the cache)."""
    import torch

    path = onnx_path(model.name)
    if path.exists():
        return path
    CACHE.mkdir(parents=True, exist_ok=True)
    feeds = model.inputs(np.random.default_rng(0))
    module = FirstOutput(model.build())
    args = tuple(torch.from_numpy(v) for v in feeds.values())
    with torch.no_grad():
        torch.onnx.export(module, args, str(path), opset_version=17, dynamo=False,
                          input_names=list(feeds), output_names=["out"])
    return path


def quantized(name: str, kind: str) -> Path:
    """The export quantized by ONNX Runtime as its documentation advises, made once into the
    cache: ``quant_pre_process`` (shape inference and graph optimization) first, then
    ``qdq``: ``quantize_static`` in QDQ format, u8 activations and s8 weights calibrated on
    :data:`CALIBRATION_SAMPLES` random inputs of the model; ``dynamic``:
    ``quantize_dynamic``, s8 weights."""
    from onnxruntime import quantization as q
    from onnxruntime.quantization.shape_inference import quant_pre_process

    path = CACHE / f"{name}_int8_{kind}_pre.onnx"
    if path.exists():
        return path
    src = export(ALL_MODELS[name])
    tmp = path.with_suffix(f".{os.getpid()}.tmp.onnx")
    pre = path.with_suffix(f".{os.getpid()}.pre.onnx")
    with contextlib.chdir(CACHE):  # its shape inference leaves temporary files in the cwd
        try:
            quant_pre_process(str(src), str(pre))
        except Exception:  # noqa: BLE001 - ORT's symbolic shape inference gives up (Swin-T)
            quant_pre_process(str(src), str(pre), skip_symbolic_shape=True)
    if kind == "dynamic":
        q.quantize_dynamic(str(pre), str(tmp), weight_type=q.QuantType.QInt8)
    else:
        samples = [ALL_MODELS[name].inputs(np.random.default_rng(seed))
                   for seed in range(CALIBRATION_SAMPLES)]

        class Calibration(q.CalibrationDataReader):
            def __init__(self) -> None:
                self.batches = iter(samples)

            def get_next(self):
                return next(self.batches, None)

        q.quantize_static(str(pre), str(tmp), Calibration(), quant_format=q.QuantFormat.QDQ,
                          activation_type=q.QuantType.QUInt8, weight_type=q.QuantType.QInt8)
    pre.unlink()
    tmp.replace(path)
    return path


def model_file(name: str, precision: ZooPrecision) -> Path:
    """The ONNX file every runtime runs in ``precision``."""
    if precision.quantization:
        return quantized(name, precision.quantization)
    return export(ALL_MODELS[name])


def library_path(name: str, precision: ZooPrecision) -> Path:
    return CACHE / f"{name}{precision.suffix}.so"


def compile_all(names: list[str], precision: ZooPrecision = PRECISIONS["float32"]
                ) -> dict[str, dict]:
    """Compile each model with tpp_tvm once (exported .so in the cache); per-model info."""
    import tpp_tvm

    info = {}
    for name in names:
        entry: dict = {"title": ALL_MODELS[name].title, "layers": ALL_MODELS[name].layers}
        try:
            path = model_file(name, precision)
            t0 = time.perf_counter()
            compiled = tpp_tvm.compile_onnx(str(path), precision=precision.tpp_tvm)
            entry["compile_s"] = round(time.perf_counter() - t0, 1)
            compiled.export(str(library_path(name, precision)))
            entry["fallbacks"] = sum(compiled.report_data.get("fallbacks", {}).values())
            entry["default_pct"] = _default_code_share(compiled, ALL_MODELS[name])
            entry["report"] = compiled.report()
        except Exception as exc:  # noqa: BLE001 - a model that fails is a row saying why
            entry["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"
        print(f"[zoo] {name}: {entry.get('error') or str(entry['compile_s']) + ' s'}",
              file=sys.stderr, flush=True)
        info[name] = entry
    return info


def compile_parallel(names: list[str], precision: str, jobs: int) -> dict[str, dict]:
    """:func:`compile_all` split over ``jobs`` processes (exports first, in this one, so
    two processes never write the same file); model order kept."""
    if jobs <= 1 or len(names) < 2:
        return compile_all(names, PRECISIONS[precision])
    for name in names:
        try:
            model_file(name, PRECISIONS[precision])
        except Exception as exc:  # noqa: BLE001 - compile_all reports it as the row's error
            print(f"[zoo] {name}: export failed: {exc}", file=sys.stderr, flush=True)
    shares = [names[k::jobs] for k in range(jobs)]
    procs = [subprocess.Popen([sys.executable, str(HERE / "zoo.py"), "--models", ",".join(share),
                               "--compile-worker", "--precision", precision],
                              stdout=subprocess.PIPE, text=True) for share in shares if share]
    info: dict[str, dict] = {}
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode == 0:
            info.update(json.loads(out.strip().splitlines()[-1]))
    return {name: info.get(name, {"title": ALL_MODELS[name].title,
                                  "layers": ALL_MODELS[name].layers,
                                  "error": "the compile worker died"}) for name in names}


def _default_code_share(compiled, model: ZooModel) -> float:
    """Percent of a profiled run spent in functions left on TVM's default code."""
    feeds = model.inputs(np.random.default_rng(1))
    times = {symbol: ms for symbol, ms, _ in compiled.profile(**feeds, repeat=2)}
    rest = compiled.report_data.get("default_scheduled", [])
    total = sum(times.values()) or 1.0
    return round(100 * sum(times.get(symbol, 0.0) for symbol in rest) / total, 1)


def ort_session(path: str, threads: int):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    # tpp_tvm's kernels flush denormals; every peer gets its switch for the same.
    opts.add_session_config_entry("session.set_denormal_as_zero", "1")
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def model_runners(name: str, threads: int, impls: list[str],
             precision: ZooPrecision = PRECISIONS["float32"]
             ) -> dict[str, Callable[[dict], np.ndarray]]:
    path = str(model_file(name, precision))
    runners: dict[str, Callable[[dict], np.ndarray]] = {}
    so = library_path(name, precision)
    if "tpp_tvm" in impls and so.exists():
        import tpp_tvm

        compiled = tpp_tvm.load(str(so))
        runners["tpp_tvm"] = lambda feeds: compiled(**feeds)[0]
    if "onnxruntime" in impls:
        sess = ort_session(path, threads)
        runners["onnxruntime"] = lambda feeds: sess.run(None, feeds)[0]
    fp32 = str(model_file(name, PRECISIONS["float32"]))
    optimized = ort_optimized(name) if "onnxruntime_opt" in impls else None
    if optimized is not None:
        opt_session = ort_session(str(optimized), threads)
        runners["onnxruntime_opt"] = lambda feeds: opt_session.run(None, feeds)[0]
    if "onnxruntime_fp32" in impls:
        fp32_session = ort_session(fp32, threads)
        runners["onnxruntime_fp32"] = lambda feeds: fp32_session.run(None, feeds)[0]
    for impl, model_path, hint in (("openvino", path, precision.openvino_hint),
                                   ("openvino_fp32", fp32, "f32")):
        if impl in impls:
            runners[impl] = _openvino_runner(model_path, threads, hint)
    if "torch" in impls:
        import torch

        torch.set_num_threads(threads)
        torch.set_flush_denormal(True)
        module = FirstOutput(ALL_MODELS[name].build())

        def run_torch(feeds):
            with torch.no_grad():
                return module(*[torch.from_numpy(v) for v in feeds.values()]).numpy()
        runners["torch"] = run_torch
    return runners


def _openvino_runner(path: str, threads: int, hint: str | None
                     ) -> Callable[[dict], np.ndarray]:
    import openvino as ov

    config: dict = {"INFERENCE_NUM_THREADS": threads, "CPU_DENORMALS_OPTIMIZATION": True}
    if hint:
        config["INFERENCE_PRECISION_HINT"] = hint
    request = ov.Core().compile_model(path, "CPU", config).create_infer_request()
    return lambda feeds: np.array(request.infer(feeds)[0])


def failure_text(exc: Exception, limit: int = 300) -> str:
    """A runtime's error in one line: its message without the "Exception from <file>"
    lines OpenVINO stacks above it, the middle elided when long."""
    lines = [line.strip() for line in str(exc).splitlines()
             if line.strip() and not line.strip().startswith("Exception from")]
    text = " ".join(lines) or type(exc).__name__
    return text if len(text) <= limit else f"{text[:limit // 2]} … {text[-limit // 2:]}"
