"""Real architectures as a new user meets them: tpp_tvm against ONNX Runtime, OpenVINO (f32)
and torch eager on models built from Hugging Face ``transformers`` configs.

Each model is built from its config with random weights (``torch.manual_seed(0)``, nothing
downloaded), exported with ``torch.onnx.export(opset_version=17, dynamo=False)`` and run by
every runtime on the same random input. Layer counts of the deep models are cut (the
``layers`` column) so the whole zoo compiles and runs on a 2-core machine in minutes; the
per-layer work, widths and operators are the real architecture's.

The parent compiles each model once with tpp_tvm (``compile_onnx``, exported to the cache
folder); one worker process per runtime and thread count then times every model (median
of the rounds). Runtimes never share a process: OpenVINO's worker threads alone, idle
between calls, made tpp_tvm and ONNX Runtime 1.5x slower at 1 thread on a 2-vCPU machine.
Correctness is the max abs error relative to max |ORT output|::

    python benchmarks/zoo.py                         # all models, 1 and 2 threads
    python benchmarks/zoo.py --models gpt2,vit --threads 1 --rounds 10
    python benchmarks/zoo.py --precision bf16 --models bert,distilbert,gpt2,vit
    python benchmarks/zoo.py --set more              # 14 more architectures: zoo_more.md
    python benchmarks/zoo.py --set breadth           # timm/torchvision: zoo_breadth.md

Every peer flushes denormals as tpp_tvm's kernels do (ONNX Runtime
``session.set_denormal_as_zero``, OpenVINO ``CPU_DENORMALS_OPTIMIZATION``,
``torch.set_flush_denormal``). An fp32 row whose tpp_tvm output is further than
``FP32_TOLERANCE`` from ONNX Runtime's is marked wrong, left out of the geometric means,
and makes the run exit non-zero.

``--precision bf16`` compiles tpp_tvm with ``precision="bf16"`` (AMX tiles on AMX hosts) and
runs OpenVINO with ``INFERENCE_PRECISION_HINT=bf16``; ONNX Runtime (fp32) stays as the
reference the errors are measured against. It writes ``zoo_bf16.md``/``zoo_bf16.json``.

``--precision int8`` quantizes each export as a user would, with ONNX Runtime's
``quantize_static`` (QDQ, u8 activations, s8 weights, calibrated on the model's input), and
runs that one file in every runtime: tpp_tvm (int8 TPPs, AMX tiles on AMX hosts), ONNX
Runtime and OpenVINO (its default precision, which keeps the int8 parts int8).
``--precision int8-dynamic`` does the same with ``quantize_dynamic`` (s8 weights, activations
quantized at run time). Errors are against ONNX Runtime fp32 on the unquantized model, for
tpp_tvm and for ONNX Runtime's own int8 run. They write ``zoo_int8.md`` /
``zoo_int8_dynamic.md``.

Writes ``results/<isa>-<cpu>/zoo.md`` and ``zoo.json`` (one folder per CPU model, named as
``tune_logs/`` are, e.g. ``amx-emeraldrapids``; ``--out`` for another folder), each naming
the CPU it ran on: a result measured on one CPU says nothing about another.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from harness import keep_fastest

HERE = Path(__file__).resolve().parent
CACHE = Path(tempfile.gettempdir()) / "tpp_tvm_zoo"
IMPLS = ("tpp_tvm", "onnxruntime", "openvino", "torch")
IMPL_TITLES = {"tpp_tvm": "tpp_tvm", "onnxruntime": "ONNX Runtime", "openvino": "OpenVINO",
               "torch": "torch"}


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


def _stub_torchvision_ops() -> None:
    """Empty modules under the two names that register the fakes of ``torchvision``'s C ops:
    the registry's wheel is a CUDA build whose ops do not load beside the CPU torch, so
    ``import torchvision`` (which ``transformers`` and ``timm`` do whenever it is installed)
    dies there; its pure-Python model code imports and runs without them."""
    for name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
        sys.modules.setdefault(name, types.ModuleType(name))


def _hf(config_name: str, model_name: str, **config) -> Callable[[], object]:
    def build():
        import torch

        _stub_torchvision_ops()
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
    _stub_torchvision_ops()
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


class _FirstOutput:
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
    module = _FirstOutput(model.build())
    args = tuple(torch.from_numpy(v) for v in feeds.values())
    with torch.no_grad():
        torch.onnx.export(module, args, str(path), opset_version=17, dynamo=False,
                          input_names=list(feeds), output_names=["out"])
    return path


def quantized(name: str, kind: str) -> Path:
    """The export quantized by ONNX Runtime (``qdq``: ``quantize_static``, QDQ format, u8
    activations and s8 weights calibrated on the model's input; ``dynamic``:
    ``quantize_dynamic``, s8 weights), made once into the cache."""
    from onnxruntime import quantization as q

    path = CACHE / f"{name}_int8_{kind}.onnx"
    if path.exists():
        return path
    src = export(ALL_MODELS[name])
    tmp = path.with_suffix(f".{os.getpid()}.tmp.onnx")
    if kind == "dynamic":
        q.quantize_dynamic(str(src), str(tmp), weight_type=q.QuantType.QInt8)
    else:
        feeds = ALL_MODELS[name].inputs(np.random.default_rng(0))

        class Calibration(q.CalibrationDataReader):
            def __init__(self) -> None:
                self.batches = iter([feeds])

            def get_next(self):
                return next(self.batches, None)

        q.quantize_static(str(src), str(tmp), Calibration(), quant_format=q.QuantFormat.QDQ,
                          activation_type=q.QuantType.QUInt8, weight_type=q.QuantType.QInt8)
    tmp.replace(path)
    return path


def model_file(name: str, precision: ZooPrecision) -> Path:
    """The ONNX file every runtime runs in ``precision``."""
    if precision.quantization:
        return quantized(name, precision.quantization)
    return export(ALL_MODELS[name])


def _library(name: str, precision: ZooPrecision) -> Path:
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
            compiled.export(str(_library(name, precision)))
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
    procs = [subprocess.Popen([sys.executable, __file__, "--models", ",".join(share),
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


def _ort_session(path: str, threads: int):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    # tpp_tvm's kernels flush denormals; every peer gets its switch for the same.
    opts.add_session_config_entry("session.set_denormal_as_zero", "1")
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def _runners(name: str, threads: int, impls: list[str],
             precision: ZooPrecision = PRECISIONS["float32"]
             ) -> dict[str, Callable[[dict], np.ndarray]]:
    path = str(model_file(name, precision))
    runners: dict[str, Callable[[dict], np.ndarray]] = {}
    so = _library(name, precision)
    if "tpp_tvm" in impls and so.exists():
        import tpp_tvm

        compiled = tpp_tvm.load(str(so))
        runners["tpp_tvm"] = lambda feeds: compiled(**feeds)[0]
    if "onnxruntime" in impls:
        sess = _ort_session(path, threads)
        runners["onnxruntime"] = lambda feeds: sess.run(None, feeds)[0]
    if "openvino" in impls:
        import openvino as ov

        config: dict = {"INFERENCE_NUM_THREADS": threads, "CPU_DENORMALS_OPTIMIZATION": True}
        if precision.openvino_hint:
            config["INFERENCE_PRECISION_HINT"] = precision.openvino_hint
        ov_model = ov.Core().compile_model(path, "CPU", config)
        request = ov_model.create_infer_request()
        runners["openvino"] = lambda feeds: np.array(request.infer(feeds)[0])
    if "torch" in impls:
        import torch

        torch.set_num_threads(threads)
        torch.set_flush_denormal(True)
        module = _FirstOutput(ALL_MODELS[name].build())

        def run_torch(feeds):
            with torch.no_grad():
                return module(*[torch.from_numpy(v) for v in feeds.values()]).numpy()
        runners["torch"] = run_torch
    return runners


def _failure_text(exc: Exception, limit: int = 300) -> str:
    """A runtime's error in one line: its message without the "Exception from <file>"
    lines OpenVINO stacks above it, the middle elided when long."""
    lines = [line.strip() for line in str(exc).splitlines()
             if line.strip() and not line.strip().startswith("Exception from")]
    text = " ".join(lines) or type(exc).__name__
    return text if len(text) <= limit else f"{text[:limit // 2]} … {text[-limit // 2:]}"


def run_worker(names: list[str], threads: int, rounds: int, impls: list[str],
               precision: ZooPrecision = PRECISIONS["float32"]) -> list[dict]:
    """Time ``impls`` on each model in this process (round-robin if several)."""
    rows = []
    for name in names:
        feeds = ALL_MODELS[name].inputs(np.random.default_rng(1))
        try:
            runners = _runners(name, threads, impls, precision)
        except Exception as exc:  # noqa: BLE001 - a runtime that fails is a cell saying so
            rows += [{"model": name, "impl": impl, "threads": threads,
                      "error": _failure_text(exc)} for impl in impls]
            continue
        outputs = {impl: run(feeds) for impl, run in runners.items()}  # warm-up
        times: dict[str, list[float]] = {impl: [] for impl in runners}
        for _ in range(rounds):
            for impl, run in runners.items():
                t0 = time.perf_counter()
                run(feeds)
                times[impl].append(time.perf_counter() - t0)
        ref = (outputs["onnxruntime"] if "onnxruntime" in outputs and not precision.quantization
               else _ort_session(str(onnx_path(name)), 1).run(None, feeds)[0])
        scale = float(np.abs(ref).max()) or 1.0
        for impl in runners:
            err = float(np.abs(outputs[impl].reshape(ref.shape) - ref).max()) / scale
            rows.append({"model": name, "impl": impl, "threads": threads,
                         "median_ms": 1e3 * float(np.median(times[impl])), "rel_err": err})
        print(f"[zoo] {name} @{threads}: " + ", ".join(
            f"{r['impl']} {r['median_ms']:.2f}" for r in rows if r["model"] == name
            and r.get("threads") == threads and "impl" in r), file=sys.stderr, flush=True)
    return rows


def _geomean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


#: Title, tpp_tvm / ORT / OpenVINO column names and what err compares, by ``--precision``.
_RENDERING = {
    "float32": ("# Model zoo: tpp_tvm vs ONNX Runtime, OpenVINO f32 and torch eager",
                ("tpp_tvm", "ORT", "OpenVINO f32"), "max |tpp_tvm - ORT| / max |ORT|"),
    "bf16": ("# Model zoo in bf16: tpp_tvm bf16 vs OpenVINO bf16 (ONNX Runtime fp32 for "
             "reference)", ("tpp_tvm bf16", "ORT", "OpenVINO bf16"),
             "max |tpp_tvm - ORT| / max |ORT|"),
    "int8": ("# Model zoo in int8 (ONNX Runtime's static QDQ quantization): tpp_tvm vs ONNX "
             "Runtime and OpenVINO on the same quantized model",
             ("tpp_tvm int8", "ORT int8", "OpenVINO int8"),
             "max |x - ORT fp32| / max |ORT fp32| (ORT fp32 on the unquantized model), x "
             "tpp_tvm's output (err) or ORT int8's (ORT err)"),
    "int8-dynamic": ("# Model zoo in int8 (ONNX Runtime's dynamic quantization): tpp_tvm vs "
                     "ONNX Runtime and OpenVINO on the same quantized model",
                     ("tpp_tvm int8", "ORT int8", "OpenVINO int8"),
                     "max |x - ORT fp32| / max |ORT fp32| (ORT fp32 on the unquantized "
                     "model), x tpp_tvm's output (err) or ORT int8's (ORT err)"),
}


def render(rows: list[dict], info: dict[str, dict], threads: list[int], cpu: str,
           precision: str = "float32") -> str:
    by = {(r["model"], r.get("impl"), r["threads"]): r for r in rows}
    title, (tpp_title, ort_title, ov_title), err_text = _RENDERING[precision]
    quantized = PRECISIONS[precision].quantization is not None
    lines = [title,
             "", f"CPU: {cpu}. Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. "
             f"Command: `python benchmarks/zoo.py {' '.join(sys.argv[1:])}`.",
             "Median ms of the rounds, one process per runtime (with --passes, the fastest "
             "of the alternating passes); ratios are peer time / "
             f"tpp_tvm time (> 1: tpp_tvm faster); err is {err_text}.", ""]
    failures: list[str] = []
    wrong_rows: list[str] = []
    for t in threads:
        lines += [f"## {t} thread{'s' if t > 1 else ''}", "",
                  f"| model | layers | {tpp_title} | {ort_title} | {ov_title} | "
                  "torch | ORT/tpp | OV/tpp | err |" + (" ORT err |" if quantized else "")
                  + " compile s | fallbacks | default % |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if quantized else "")
                  + "---:|---:|---:|"]
        ort_ratios, ov_ratios = [], []
        for name, entry in info.items():
            cells = {impl: by.get((name, impl, t)) for impl in IMPLS}
            ms = {impl: (c.get("median_ms") if c else None) for impl, c in cells.items()}
            failures += [f"- {entry['title']}, {IMPL_TITLES[impl]}, {t} thread"
                         f"{'s' if t > 1 else ''}: {c['error']}"
                         for impl, c in cells.items() if c and "error" in c]
            tpp = ms["tpp_tvm"]
            wrong = _wrong(cells["tpp_tvm"], precision)
            if wrong:
                wrong_rows.append(f"- {entry['title']}, {t} thread{'s' if t > 1 else ''}: "
                                  f"err {cells['tpp_tvm']['rel_err']:.1e}")
                tpp = None  # no ratio for a wrong output
            # bf16 is compared with bf16 peers only: ONNX Runtime runs fp32 there
            ratio_ort = ms["onnxruntime"] / tpp if tpp and ms["onnxruntime"] \
                and precision != "bf16" else None
            ratio_ov = ms["openvino"] / tpp if tpp and ms["openvino"] else None
            if ratio_ort:
                ort_ratios.append(ratio_ort)
            if ratio_ov:
                ov_ratios.append(ratio_ov)
            def fmt(impl: str) -> str:
                if cells[impl] and "error" in cells[impl]:
                    return "fails"
                if impl == "tpp_tvm" and wrong:
                    return f"**wrong** ({ms[impl]:.2f})"
                return "–" if ms[impl] is None else f"{ms[impl]:.2f}"

            def ratio(value: float | None) -> str:
                return "–" if value is None else f"{value:.2f}"

            def err(impl: str) -> str:
                value = (cells[impl] or {}).get("rel_err")
                return "–" if value is None else f"{value:.1e}"

            title = entry["title"] + (f" — **{entry['error']}**" if "error" in entry else "")
            lines.append(f"| {title} | {entry['layers']} | {fmt('tpp_tvm')} | "
                         f"{fmt('onnxruntime')} | {fmt('openvino')} | {fmt('torch')} "
                         f"| {ratio(ratio_ort)} | {ratio(ratio_ov)} | {err('tpp_tvm')} |"
                         + (f" {err('onnxruntime')} |" if quantized else "")
                         + f" {entry.get('compile_s', '–')} | {entry.get('fallbacks', '–')} |"
                         + f" {entry.get('default_pct', '–')} |")
        g_ort, g_ov = _geomean(ort_ratios), _geomean(ov_ratios)
        lines += ["", f"Geometric mean over the models that ran: ORT/tpp_tvm "
                  f"{'–' if g_ort is None else f'{g_ort:.2f}'}, OpenVINO/tpp_tvm "
                  f"{'–' if g_ov is None else f'{g_ov:.2f}'}.", ""]
    if failures:
        lines += ["Runtimes that failed (the cell says `fails`):", "", *failures, ""]
    if wrong_rows:
        lines += [f"Wrong outputs (err above {FP32_TOLERANCE:g}; left out of the means):", "",
                  *wrong_rows, ""]
    lines += ["`default %`: share of a profiled tpp_tvm run in functions left on TVM's "
              "default code (no TPP kernel).", ""]
    return "\n".join(lines) + "\n"


def _merged(old: dict, rows: list[dict], info: dict[str, dict], order: list[str]
            ) -> tuple[list[dict], dict[str, dict]]:
    """The rows and model entries of an earlier results file, those of the models re-run
    now replaced, in the set's order."""
    kept = [r for r in old["rows"] if r["model"] not in info]
    models = {**old["models"], **info}
    return kept + rows, {name: models[name] for name in order if name in models}


def _wrong(cell: dict | None, precision: str) -> bool:
    """An fp32 tpp_tvm output further from ONNX Runtime's than :data:`FP32_TOLERANCE`."""
    return (precision == "float32" and bool(cell) and "rel_err" in cell
            and cell["rel_err"] > FP32_TOLERANCE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--set", default="main", choices=list(SETS),
                        help="main: the twelve architectures; more: operators and forms "
                             "beyond them (writes zoo_more.md); breadth: timm and "
                             "torchvision image architectures (zoo_breadth.md)")
    parser.add_argument("--models", help="comma-separated names (default: the whole set)")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--passes", type=int, default=1,
                        help="run every runtime's worker this many times, alternating, and "
                             "keep each one's fastest pass (drift on shared machines)")
    parser.add_argument("--out", type=Path, help="results folder (default: results/<cpu>)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other models' rows of the set's existing results file "
                             "and replace only the models given (re-run a few rows)")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--compile-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--jobs", type=int, default=1,
                        help="compile the models in this many processes (timing stays one "
                             "process at a time)")
    parser.add_argument("--impls", default=",".join(IMPLS),
                        help="runtimes to time (default: all; tpp_tvm and onnxruntime needed "
                             "for the ratios)")
    parser.add_argument("--precision", default="float32", choices=list(PRECISIONS),
                        help="bf16: tpp_tvm precision='bf16' against OpenVINO bf16; int8 / "
                             "int8-dynamic: every runtime on ONNX Runtime's static QDQ / "
                             "dynamic quantization of the export")
    args = parser.parse_args(argv)
    precision = PRECISIONS[args.precision]
    names = [n for n in (args.models or ",".join(SETS[args.set])).split(",") if n]
    unknown = [n for n in names if n not in ALL_MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(ALL_MODELS)}")
    if args.worker:
        print(json.dumps(run_worker(names, args.worker, args.rounds, args.impls.split(","),
                                    precision)))
        return 0
    if args.compile_worker:
        print(json.dumps(compile_all(names, precision)))
        return 0
    threads = [int(t) for t in args.threads.split(",")]
    info = compile_parallel(names, args.precision, args.jobs)
    ok = [n for n in names if "error" not in info[n]]
    rows: list[dict] = []
    for t in threads:
        env = {**os.environ, "TVM_NUM_THREADS": str(t), "OMP_NUM_THREADS": str(t)}
        # One process per runtime: idle worker threads of one runtime (TVM's, OpenMP's,
        # OpenVINO's spin after each call) take cores from the next one in the same
        # process (ORT ran BERT slower at 2 threads than at 1; with OpenVINO loaded,
        # tpp_tvm and ORT ran EfficientNet 1.5x slower at 1 thread).
        groups = [[impl] for impl in args.impls.split(",")
                  if not (args.precision != "float32" and impl == "torch")]
        for _ in range(args.passes):
            for impls in groups:
                cmd = [sys.executable, __file__, "--models", ",".join(ok), "--rounds",
                       str(args.rounds), "--worker", str(t), "--impls", ",".join(impls),
                       "--precision", args.precision]
                out = subprocess.run(cmd, env=env, capture_output=True, text=True)
                sys.stderr.write(out.stderr[-4000:])
                if out.returncode == 0:
                    rows = keep_fastest(rows + json.loads(out.stdout.strip().splitlines()[-1]),
                                        ("model", "impl", "threads"), "median_ms")
    from harness import results_dir

    import tpp_tvm
    from tpp_tvm.target import host_isa

    host = host_isa()
    args.out = args.out or results_dir()
    from tpp_tvm.tuning import target_tag

    cpu = f"{host.model_name}, LLVM `{target_tag(tpp_tvm.target())}` ({host.summary()})"
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "zoo" + ("" if args.set == "main" else f"_{args.set}") + precision.suffix
    runs = [{"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
             "command": f"python benchmarks/zoo.py {' '.join(sys.argv[1:])}",
             "models": list(info)}]
    if args.merge and (args.out / f"{stem}.json").exists():
        old = json.loads((args.out / f"{stem}.json").read_text())
        rows, info = _merged(old, rows, info, list(SETS[args.set]))
        runs = old.get("runs", [{"date": "earlier", "command": "the file's first run"}]) + runs
    (args.out / f"{stem}.json").write_text(json.dumps(
        {"cpu": cpu, "precision": args.precision, "rows": rows, "models": info,
         "runs": runs}, indent=1))
    text = render(rows, info, threads, cpu, args.precision)
    if len(runs) > 1:  # say which rows came from which run
        text += "Runs merged into this table (later runs replace the rows of their models):\n\n"
        text += "".join(f"- {r['date']}: `{r['command']}`\n" for r in runs) + "\n"
    (args.out / f"{stem}.md").write_text(text)
    print((args.out / f"{stem}.md").read_text())
    wrong = [r for r in rows if r.get("impl") == "tpp_tvm" and _wrong(r, args.precision)]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
