"""Where vlpack plugs into transformers, installed by class at build time (the classes per family
are in `vlpack.families`).

Each seam is a subclass of one stock class that overrides one method (`forward`; the deepstack
text model also its merge), made once per stock class and given to the model's instances of
exactly that class (`module.__class__ = subclass`): the weights, config and every other method
stay the stock ones, and the subclass is a class of this module, so a model pickles and deep-
copies as usual. The text attention needs no subclass: it is registered with transformers'
AttentionInterface (attention.py). The base model's subclass overrides three methods: `forward`,
to hand a stock call's 2-D attention mask to that attention (`attention.StockMask`), and
`get_image_features` and `get_placeholder_mask` (vision.py `ImageFeatures`).
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


def install(model: nn.Module, name: str) -> dict[str, int]:
    """Give `model`'s modules of family `name`'s seam classes (`vlpack.families`) their
    subclasses; returns how many of each kind. Idempotent."""
    seams = family(name)
    mod = importlib.import_module(seams.modeling_module)
    pairs = {"vision_attention": (seams.vision_attention, VisionAttention),
             "vision_tower": (seams.vision_tower, VisionTower),
             "image_features": (seams.model_class, BaseModel)}
    if seams.deepstack_text_model is not None:
        pairs["deepstack"] = (seams.deepstack_text_model, DeepstackTextModel)
    if seams.gated_deltanet is not None:
        pairs["gated_deltanet"] = (seams.gated_deltanet, GatedDeltaNet)
    counts = dict.fromkeys(pairs, 0)
    for kind, (name, mixin) in pairs.items():
        stock = getattr(mod, name, None)
        if stock is None:
            raise ValueError(f"{mod.__name__} has no {name}: this transformers version is not "
                             f"supported by vlpack (tested: {TESTED_TRANSFORMERS})")
        sub = packed_class(stock, mixin)
        for m in model.modules():
            if type(m) is stock:
                m.__class__ = sub
            counts[kind] += type(m) is sub
    return counts


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
