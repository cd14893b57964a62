"""The breadth set of ``benchmarks/zoo.py --set breadth``: image architectures from ``timm``
and ``torchvision`` that nothing in tpp_tvm was written or tuned for.

Each is built with random weights (``timm.create_model(name, pretrained=False)``,
``torchvision.models.<name>(weights=None)``, ``torch.manual_seed(0)``, nothing downloaded)
at batch 1 and the model's default input size, by family: mobile CNNs, re-parameterised
CNNs, dense / inception / split-attention CNNs, MLP-mixers, hybrid conv-attention models,
hierarchical and windowed vision transformers, segmentation heads.

The registry's ``torchvision`` wheels are CUDA builds: beside the CPU torch their C ops do
not load and ``import torchvision`` dies registering fakes for them (and ``timm`` imports
it). :func:`import_vision` puts empty modules under the two names that register them
first; the pure-Python model code then imports and runs.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from dataclasses import dataclass


def import_vision() -> tuple[types.ModuleType, types.ModuleType]:
    """``timm`` and ``torchvision``, importable beside the CPU torch (see above)."""
    for name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
        sys.modules.setdefault(name, types.ModuleType(name))
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
            return timm.create_model(self.name, pretrained=False).eval()
        if self.source == "torchvision.segmentation":
            return getattr(torchvision.models.segmentation, self.name)(
                weights=None, weights_backbone=None).eval()
        kwargs = {"init_weights": True} if self.name in ("googlenet", "inception_v3") else {}
        if self.name in ("googlenet", "inception_v3"):
            kwargs["aux_logits"] = False
        return getattr(torchvision.models, self.name)(weights=None, **kwargs).eval()


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


def builders() -> dict[str, tuple[str, Callable[[], object], int]]:
    """Per set name: (title, build, input size) for :mod:`zoo`."""
    return {key: (f"{a.name} ({a.source.split('.')[0]}, {a.family})", a.build, a.size)
            for key, a in ARCHITECTURES.items()}
