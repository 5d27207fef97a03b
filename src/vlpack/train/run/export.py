"""`vlpack export`: a checkpoint or a live model as a folder a serving engine loads.

`--hf` (the default) writes a transformers folder: `config.json` (its `dtype` the exported
dtype, bf16 by default), `model-0000K-of-0000N.safetensors` shards with
`model.safetensors.index.json`, in the published checkpoints' tensor names (transformers'
`revert_weight_conversion`), a LoRA adapter folded into its base weights; and the files a
serving engine reads besides (`serving.py`). `--adapter` writes a LoRA run's adapter in peft's
format. Shards are written one at a time: each is fetched (gathered from FSDP2 shards, or read
from the checkpoint), merged, cast and written before the next, so no host holds more than one
shard beyond the frozen base a LoRA run builds anyway.

A checkpoint holds only the parameters that train. For a LoRA or `model.freeze_*` run the export
builds the frozen base again as the trainer did (the run's `model.name`, seed and `model.init`,
in the dtype the trainer held it in), checks it against the checkpoint's record of which
parameters were frozen, and says where it came from; a full fine-tune takes every tensor from
the checkpoint and builds only shapes.
"""

from __future__ import annotations

import json
import logging
import os
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from vlpack.config import Config, load_config
from vlpack.train.distributed.parallel import Topology, barrier
from vlpack.train.run import checkpoint as ckpt

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SHARD_BYTES = 5 * 10**9
"""Largest safetensors shard an export writes (a tensor larger than this gets its own)."""
INDEX = "model.safetensors.index.json"

Fetch = Callable[[list[str]], dict[str, torch.Tensor]]
"""Full tensors of the named state-dict keys (collective under FSDP2: every rank calls it with
the same keys; the main rank's values are the ones written)."""


def _clean(name: str) -> str:
    return name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")


def _tied_copies(model: nn.Module) -> set[str]:
    """Names under which a parameter appears a second time (a tied lm_head): safetensors holds
    each tensor once and transformers ties it again when loading."""
    seen: dict[int, str] = {}
    copies = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            copies.add(_clean(name))
        else:
            seen[id(p)] = name
    cfg = model.config
    if getattr(cfg, "tie_word_embeddings", False) or getattr(
            getattr(cfg, "text_config", None), "tie_word_embeddings", False):
        copies.add("lm_head.weight")
    return copies


def umask_mode(path: Path) -> None:
    """Give `path` the mode the umask allows a new file (0644 under umask 022): safetensors
    writes its files 0600, which a serving engine running as another user cannot read."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def _plan_shards(groups: dict[str, list[str]], shapes: dict[str, torch.Size], itemsize: int,
                 max_bytes: int) -> list[list[str]]:
    """The plain keys split into shards of at most `max_bytes` in the exported dtype, in
    state-dict order (a base weight's shape gives its merged weight's)."""
    shards: list[list[str]] = [[]]
    size = 0
    for plain, sources in groups.items():
        n = shapes[sources[0]].numel() * itemsize
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(plain)
        size += n
    return shards


def write_weights(model: nn.Module, out: Path, fetch: Fetch, *, dtype: torch.dtype,
                  is_main: bool = True, max_shard_bytes: int = SHARD_BYTES) -> dict:
    """Write `model`'s plain state (LoRA folded in) as safetensors shards and their index, one
    shard at a time: `fetch` gives each shard's source tensors, which are merged, cast to
    `dtype` (floating tensors) and renamed to the published checkpoints' names. Returns the
    index. Collective when `fetch` is."""
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion

    from vlpack.model import lora

    sd = {_clean(k): v for k, v in model.state_dict().items()}
    tied = _tied_copies(model)
    groups = lora.merge_groups(model, [k for k in sd if k not in tied])
    shards = _plan_shards(groups, {k: v.shape for k, v in sd.items()},
                          torch.tensor([], dtype=dtype).element_size(), max_shard_bytes)
    if is_main:  # an earlier export's shards, which the new index would not name
        for old in [*out.glob("model-*-of-*.safetensors"), out / "model.safetensors"]:
            old.unlink(missing_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    named = _plain(model)
    for i, plain_keys in enumerate(shards):
        sources = [s for k in plain_keys for s in groups[k]]
        tensors = fetch(sources)
        if not is_main:
            continue
        if getattr(model, "_vlpack_lora", None) is not None:
            tensors = lora.merged_state_dict(model, tensors)
        part = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}
        part = revert_weight_conversion(named, part)
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: v.detach().cpu().contiguous() for k, v in part.items()}, str(out / name),
                  metadata={"format": "pt"})
        umask_mode(out / name)
        weight_map.update(dict.fromkeys(part, name))
        total += sum(v.numel() * v.element_size() for v in part.values())
        del tensors, part
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    if is_main:
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return index


def _plain(model: nn.Module) -> nn.Module:
    """`model` without LoRA layers, as shapes (the module names transformers' weight
    conversions look parameters up by); `model` itself when it has none."""
    if getattr(model, "_vlpack_lora", None) is None:
        return model
    import copy

    with torch.device("meta"):
        return type(model)._from_config(copy.deepcopy(model.config), attn_implementation="sdpa")


def write_config(model: nn.Module, out: Path, dtype: torch.dtype) -> None:
    """`config.json` of `model` for serving: `dtype` the exported one (so `--dtype auto` in a
    serving engine serves that), the cache on, the model class as its architecture."""
    import copy

    cfg = copy.deepcopy(model.config)
    name = str(dtype).removeprefix("torch.")
    for c in (cfg, getattr(cfg, "text_config", None), getattr(cfg, "vision_config", None)):
        if c is not None:
            c.dtype = name
    for c in (cfg, getattr(cfg, "text_config", None)):
        if c is not None:
            c.use_cache = True
    cfg.architectures = [type(model).__name__]
    cfg.save_pretrained(out)


def live_fetch(model: nn.Module) -> Fetch:
    """Fetch from a live (possibly FSDP2-sharded) model: each DTensor gathered to its full
    value (a collective) and moved to the CPU."""
    sd = {_clean(k): v for k, v in model.state_dict().items()}

    def fetch(keys: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for k in keys:
            t = sd[k]
            t = t.full_tensor() if hasattr(t, "full_tensor") else t
            out[k] = t.detach().cpu()
        return out

    return fetch


def export_live(model: nn.Module, out_dir: str | Path, topo: Topology, cfg: Config,
                *, out_dtype: str = "bfloat16") -> Path:
    """Write the live `model` of run `cfg` as a transformers folder in `out_dtype` (sharded
    safetensors with their index, the LoRA adapter folded in, and the files a serving engine
    reads), gathering one shard at a time. Collective."""
    from vlpack.train.run.serving import write_serving_files

    out = Path(out_dir)
    if topo.is_main:
        out.mkdir(parents=True, exist_ok=True)
    write_weights(model, out, live_fetch(model), dtype=DTYPES[out_dtype], is_main=topo.is_main)
    if topo.is_main:
        write_config(model, out, DTYPES[out_dtype])
        write_serving_files(out, cfg, model.config.model_type)
    barrier(topo)
    return out


def export_live_adapter(model: nn.Module, out_dir: str | Path, topo: Topology, *,
                        base: str | None = None) -> Path:
    """Write the LoRA adapter of the live `model` in peft's format (`PeftModel.from_pretrained`
    loads it on the base model `base`). Collective: only the adapters' tensors are gathered
    (every rank walks the same names), never the frozen base."""
    from vlpack.model.lora import save_adapter

    keys = [k for k in (_clean(k) for k in model.state_dict()) if "lora_" in k]
    state = live_fetch(model)(keys)
    out = Path(out_dir)
    if topo.is_main:
        save_adapter(model, out, state_dict=state, base=base)
        umask_mode(out / "adapter_model.safetensors")
    barrier(topo)
    return out


def checkpoint_fetch(model: nn.Module, path: Path) -> Fetch:
    """Fetch the tensors a checkpoint holds from it (read per call, in their saved dtype) and
    the others (the frozen base) from `model`."""
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    sd = {_clean(k): v for k, v in model.state_dict().items()}

    def fetch(keys: list[str]) -> dict[str, torch.Tensor]:
        # the trainer saves its TrainModule (the HF model as `.model`) under "model"
        want = {}
        for k in keys:
            meta = saved.get(f"model.model.{k}")
            if meta is not None:
                want[f"model.{k}"] = torch.empty(meta.size, dtype=meta.properties.dtype)
        if want:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load({"model": want}, checkpoint_id=str(path))
        out = {}
        for k in keys:
            t = want.get(f"model.{k}")
            if t is None:
                t = sd[k]
                assert t.device.type != "meta", f"{k}: neither in {path} nor built"
            out[k] = t.detach().cpu()
        return out

    return fetch


# ---------------------------------------------------------------------- a saved checkpoint


def resolve(source: str | Path) -> tuple[Path, Path]:
    """(checkpoint folder, run folder) of a run folder (its latest checkpoint) or a checkpoint
    folder; a ValueError naming the path otherwise."""
    path = Path(source)
    if (path / ckpt.MARKER).is_file():
        return path, path.parent.parent
    if path.is_dir() and (latest := ckpt.latest_checkpoint(path)) is not None:
        return latest, path
    raise ValueError(f"{path} is neither a run folder with a complete checkpoint "
                     f"(checkpoints/step_*/{ckpt.MARKER}) nor a checkpoint folder: pass "
                     "OUTPUT_DIR of a run or OUTPUT_DIR/checkpoints/step_XXXXXXXX")


def run_config(run: Path, step: int) -> Config:
    """The settings step `step` was trained with: the run's `config.yaml`, or the
    `config.stepNNNNNNNN.yaml` a resume with changed settings kept (the settings up to step N)."""
    kept = sorted((int(m.group(1)), p) for p in run.glob("config.step*.yaml")
                  if (m := re.fullmatch(r"config\.step(\d+)\.yaml", p.name)))
    for at, p in kept:
        if at >= step:
            return load_config(p)
    if not (run / "config.yaml").is_file():
        raise ValueError(f"{run} has no config.yaml: the export rebuilds the model from the "
                         "run's settings; pass a checkpoint inside a vlpack run folder")
    return load_config(run / "config.yaml")


def rebuild(cfg: Config, mark: dict) -> tuple[nn.Module, str]:
    """The model of run `cfg` on the CPU with its frozen base as the trainer built it (only
    shapes when nothing is frozen), and a sentence saying where the base came from."""
    from vlpack.model.build import build_model
    from vlpack.train.setup.prepare import preparation, prepare

    m = cfg.model
    trained_on = torch.device(mark.get("device", "cpu"))
    prep = preparation(cfg, Topology(rank=0, world_size=1, local_rank=0, device=trained_on))
    random_base = m.init == "random" or not Path(m.name).is_dir()
    drawn_on = "cpu" if mark.get("sharded") else trained_on.type
    if not prep.freezes:
        device, note = torch.device("meta"), "every weight from the checkpoint"
    elif random_base and drawn_on != "cpu":
        if not torch.cuda.is_available():
            raise ValueError(
                f"this run's frozen base is random weights of {m.name} (seed {cfg.train.seed}) "
                f"drawn on a {drawn_on} device, which a checkpoint does not hold: run vlpack "
                "export on a machine with that device to draw them again")
        device = torch.device(drawn_on)
        note = f"the frozen base drawn again: random weights of {m.name}, seed {cfg.train.seed}"
    else:
        device = torch.device("cpu")
        note = (f"the frozen base drawn again: random weights of {m.name}, seed {cfg.train.seed}"
                if random_base else f"the frozen base read again from {m.name}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*RANDOM weights.*")
        model, _ = build_model(m.name, backend="sdpa", device=device, seed=cfg.train.seed,
                               dtype=prep.build_dtype, random_init=m.init == "random")
    prepare(model, prep, last="hold")  # as the trainer prepared it, up to the held dtypes
    saved = mark.get("frozen")
    root = nn.Module()  # the trainer's TrainModule names the HF model `model`
    root.model = model
    if saved is not None and saved != ckpt.frozen_fingerprint(root):
        raise ValueError("the run's settings freeze other parameters than its checkpoint "
                         "records (model.freeze_*, model.lora or model.name changed in its "
                         "config.yaml?): the export cannot rebuild what the run trained")
    return model, note


def export_checkpoint(source: str | Path, out: str | Path | None = None, *, mode: str = "hf",
                      out_dtype: str = "bfloat16", max_shard_bytes: int = SHARD_BYTES) -> Path:
    """Export a run's latest checkpoint, or the checkpoint `source`, to `out` (default
    RUN/export/step_XXXXXXXX-{hf|adapter}): a transformers folder (`mode="hf"`, in `out_dtype`)
    or the LoRA adapter in peft's format (`mode="adapter"`). Returns the folder."""
    from vlpack.train.run.serving import write_serving_files

    if mode not in ("hf", "adapter"):
        raise ValueError(f"mode {mode!r}: use hf or adapter")
    if out_dtype not in DTYPES:
        raise ValueError(f"--dtype {out_dtype}: use one of {', '.join(DTYPES)}")
    path, run = resolve(source)
    mark = ckpt.marker(path)
    cfg = run_config(run, int(mark["step"]))
    if mode == "adapter" and not cfg.model.lora.rank:
        raise ValueError(f"{path} is of a run without LoRA (model.lora.rank=0): there is no "
                         "adapter; export the whole model with --hf")
    out = Path(out) if out is not None else run / "export" / f"{path.name}-{mode}"
    model, note = rebuild(cfg, mark) if mode == "hf" else _adapter_shapes(cfg)
    out.mkdir(parents=True, exist_ok=True)
    fetch = checkpoint_fetch(model, path)
    if mode == "adapter":
        from vlpack.model.lora import save_adapter

        keys = [k for k in (_clean(k) for k in model.state_dict()) if "lora_" in k]
        save_adapter(model, out, state_dict=fetch(keys), base=cfg.model.name)
        umask_mode(out / "adapter_model.safetensors")
        print(f"vlpack: wrote the LoRA adapter of {path} to {out} (peft's format, float32; "
              f"base model {cfg.model.name})")
        return out
    write_weights(model, out, fetch, dtype=DTYPES[out_dtype], max_shard_bytes=max_shard_bytes)
    write_config(model, out, DTYPES[out_dtype])
    write_serving_files(out, cfg, model.config.model_type)
    print(f"vlpack: exported {path} to {out} in {out_dtype} ({note})")
    return out


def _adapter_shapes(cfg: Config) -> tuple[nn.Module, str]:
    """The run's model with its LoRA layers, as shapes only (an adapter needs no base)."""
    from vlpack.model.build import meta_model
    from vlpack.train.setup.prepare import Preparation, prepare

    model = meta_model(cfg.model.name)
    prepare(model, Preparation(model_name=cfg.model.name, lora=cfg.model.lora), last="lora")
    return model, "adapter only"


def parse_size(text: str) -> int:
    """Bytes of a size like `5GB`, `500MB` or `1000000`; a ValueError names the forms."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B)?\s*", text.upper())
    if m is None:
        raise ValueError(f"--max-shard-size {text!r}: use a size like 5GB, 500MB or 1000000")
    return int(float(m.group(1)) * {None: 1, "B": 1, "KB": 10**3, "MB": 10**6,
                                    "GB": 10**9}[m.group(2)])
