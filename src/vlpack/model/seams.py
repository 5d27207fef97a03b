"""Where vlpack plugs into transformers, installed by class at build time (the classes per family are
in `vlpack.families`).

Each seam is a subclass of one stock class that overrides one method (`forward`; the deepstack text
model also its merge), made once per stock class and given to the model's instances of exactly that
class (`module.__class__ = subclass`): the weights, config and every other method stay the stock
ones, and the subclass is a class of this module, so a model pickles and deep-copies as usual (a
process that unpickles one makes the classes on lookup, `__getattr__`). The text attention needs no
subclass: it is registered with transformers' AttentionInterface (attention.py). The base model's
subclass overrides three methods: `forward`, to hand a stock call's 2-D attention mask to that
attention (`attention.StockMask`), and `get_image_features` and `get_placeholder_mask` (vision.py
`ImageFeatures`).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

from torch import nn

from vlpack.families import TESTED_TRANSFORMERS, family
from vlpack.model.attention import StockMask
from vlpack.model.deepstack import DeepstackTextModel
from vlpack.model.gdn import GatedDeltaNet
from vlpack.model.vision import ImageFeatures, VisionAttention, VisionTower


class BaseModel(StockMask, ImageFeatures):
    """Mixin for a base model class: its image features (vision.py) and a stock call's mask."""


@functools.cache
def packed_class(stock: type, mixin: type) -> type:
    """`mixin` over `stock`, once per pair, registered in this module under its own name."""
    name = f"Packed{stock.__name__}"
    cls = type(name, (mixin, stock), {"__module__": __name__, "__qualname__": name,
                                      "_vlpack_stock": stock})
    globals()[name] = cls
    if hasattr(stock, "_can_record_outputs"):
        # transformers finds a model's recordable outputs (router logits, hidden states) by its
        # class name, registered when a model is constructed; the subclass registers the same
        from transformers.utils import output_capturing

        dict.__setitem__(output_capturing._CAN_RECORD_REGISTRY, str(cls), stock._can_record_outputs)
    return cls


def _seam_pairs(name: str) -> dict[str, tuple[type, type]]:
    """{kind: (stock class, mixin)} of family `name`'s seams (`vlpack.families`)."""
    seams = family(name)
    mod = importlib.import_module(seams.modeling_module)
    pairs = {"vision_attention": (seams.vision_attention, VisionAttention),
             "vision_tower": (seams.vision_tower, VisionTower),
             "image_features": (seams.model_class, BaseModel)}
    if seams.deepstack_text_model is not None:
        pairs["deepstack"] = (seams.deepstack_text_model, DeepstackTextModel)
    if seams.gated_deltanet is not None:
        pairs["gated_deltanet"] = (seams.gated_deltanet, GatedDeltaNet)
    out = {}
    for kind, (stock_name, mixin) in pairs.items():
        stock = getattr(mod, stock_name, None)
        if stock is None:
            raise ValueError(f"{mod.__name__} has no {stock_name}: this transformers version is not "
                             f"supported by vlpack (tested: {TESTED_TRANSFORMERS})")
        out[kind] = (stock, mixin)
    return out


def install(model: nn.Module, name: str) -> dict[str, int]:
    """Give `model`'s modules of family `name`'s seam classes (`vlpack.families`) their
    subclasses; returns how many of each kind. Idempotent."""
    counts = {}
    for kind, (stock, mixin) in _seam_pairs(name).items():
        sub = packed_class(stock, mixin)
        counts[kind] = 0
        for m in model.modules():
            if type(m) is stock:
                m.__class__ = sub
            counts[kind] += type(m) is sub
    return counts


def __getattr__(name: str) -> type:
    """A model unpickled in a process that built none finds its seam classes before anything
    made them: `Packed<Stock>` is made from the family registry's stock classes, and vlpack's
    attention and experts functions, which the model's config names, are registered with
    transformers as a build registers them."""
    if name.startswith("Packed"):
        from vlpack.families import FAMILIES
        from vlpack.model import attention, experts

        for fam in FAMILIES:
            try:
                pairs = _seam_pairs(fam)
            except (ImportError, ValueError):
                continue  # a family this transformers lacks cannot be the one pickled
            for stock, mixin in pairs.values():
                if f"Packed{stock.__name__}" == name:
                    attention.register()
                    experts.register()
                    return packed_class(stock, mixin)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class StockClasses:
    """The transformers classes of one family that vlpack treats specially, resolved from the
    family registry (`vlpack.families`)."""

    vision_attention: type
    gated_deltanet: type | None
    moe_block: type | None
    experts: type | None
    router: type | None
    compiled: tuple[type, ...]
    """Norms and MLPs `model.compile` compiles as regions (torch's LayerNorm among them)."""

    @property
    def eager(self) -> tuple[type, ...]:
        """Modules that stay eager inside a compiled layer (model/compile.py says why)."""
        return tuple(c for c in (self.moe_block, self.gated_deltanet, self.vision_attention)
                     if c is not None)


@functools.cache
def stock_classes(name: str) -> StockClasses:
    """The `StockClasses` of family `name` (a HF model_type)."""
    fam = family(name)
    mod = importlib.import_module(fam.modeling_module)

    def get(cls_name: str | None) -> type | None:
        if cls_name is None:
            return None
        cls = getattr(mod, cls_name, None)
        if cls is None:
            raise ValueError(f"{mod.__name__} has no {cls_name}: this transformers version is "
                             f"not supported by vlpack (tested: {TESTED_TRANSFORMERS})")
        return cls

    block, experts, router = fam.moe or (None, None, None)
    return StockClasses(get(fam.vision_attention), get(fam.gated_deltanet), get(block),
                        get(experts), get(router),
                        (*(get(c) for c in fam.compiled), nn.LayerNorm))


def classes_of(model: nn.Module) -> StockClasses:
    """The `StockClasses` of `model`'s family (read from its config's `model_type`); a
    ValueError for a model outside the six families."""
    config = getattr(model, "config", None)
    name = getattr(config, "model_type", None)
    if name is None:
        raise ValueError(f"{type(model).__name__} is not a Qwen vision-language model: vlpack "
                         "finds its layers from the model's config.model_type")
    return stock_classes(name)
