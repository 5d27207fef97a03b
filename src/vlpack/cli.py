"""The `vlpack` command line. Each subcommand parses its flags here and hands off to the module
that owns the work (imported lazily so `vlpack --help` stays fast)."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from pathlib import Path


class _Formatter(argparse.HelpFormatter):
    """argparse's formatter, wrapping lines at spaces only: a name such as `tiny-qwen2_vl` or
    `qwen3.5-35b-a3b` stays whole (textwrap breaks at hyphens by default)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        text = self._whitespace_matcher.sub(" ", text).strip()
        return textwrap.wrap(text, width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        text = self._whitespace_matcher.sub(" ", text).strip()
        return textwrap.fill(text, width, initial_indent=indent, subsequent_indent=indent,
                             break_on_hyphens=False)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose `epilog` may be a function, called only when its help is printed
    (the preset list imports the model code, which `vlpack --help` should not wait for), and
    whose help wraps at spaces only (`_Formatter`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def format_help(self) -> str:
        if callable(self.epilog):
            self.epilog = self.epilog()
        return super().format_help()


def _recipes() -> str:
    """The shipped recipe names (`configs/*.yaml`), comma-separated."""
    return ", ".join(sorted(p.stem for p in (Path(__file__).parent / "configs").glob("*.yaml")))


def _presets_epilog() -> str:
    from vlpack.model.presets import PRESETS

    return ("Model presets (random weights of a published model's shapes; tiny-* are small "
            f"test models): {', '.join(sorted(PRESETS))}. Or a local HF checkpoint folder.")


def _add_synth(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("synth", help="write the built-in synthetic receipts dataset")
    p.add_argument("--out", required=True, help="output folder (data.jsonl + images/)")
    p.add_argument("--n", type=int, default=256, help="number of samples")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the receipts' contents and images (same seed, same dataset)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the data.jsonl, images/ and videos/ already in --out (else "
                   "such a folder is refused)")
    p.set_defaults(func=_run_synth)


def _run_synth(args: argparse.Namespace) -> int:
    from vlpack.data.synth import write_synthetic

    path = write_synthetic(args.out, n=args.n, seed=args.seed, show_progress=True,
                           overwrite=args.overwrite)
    print(f"wrote {args.n} samples to {path}")
    return 0


def _add_energon_prepare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("energon-prepare",
                       help="write WebDataset shards of a JSONL dataset and prepare them for Energon")
    p.add_argument("data", help="DATA.jsonl (image paths relative to it)")
    p.add_argument("out", help="new or empty folder for the Energon dataset")
    p.add_argument("--shard-size", type=int, default=1000, help="samples per tar shard")
    _add_media_root(p)
    p.set_defaults(func=_run_energon_prepare)


def _run_energon_prepare(args: argparse.Namespace) -> int:
    from vlpack.data.energon.prepare import prepare_energon
    from vlpack.data.types import printable

    r = prepare_energon(_data_file(args), args.out, shard_size=args.shard_size,
                        show_progress=False)
    for p in r["problems"][:20]:
        print(f"left out: {p['reason']}: {printable(p['message'])}")
    if len(r["problems"]) > 20:
        print(f"... and {len(r['problems']) - 20} more (all in {args.out}/vlpack-prepare.json)")
    left_out = f"; left out: {r['skipped']}" if r["skipped"] else ""
    print(f"wrote {r['samples']} samples in {r['shards']} shards to {args.out} and prepared them "
          f"for Energon{left_out}; train with data.source=energon data.path={args.out}")
    return 0


def _add_encoder_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--family", default="qwen3_vl",
                   help="tokenizer/processor family: qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_5")
    p.add_argument("--tokenizer", default=None,
                   help="local HF checkpoint folder: its tokenizer, chat template and image "
                        "settings, as training with model.name=FOLDER uses them")
    from vlpack.config import DataConfig, default_of

    p.add_argument("--chat-template", default=default_of(DataConfig, "chat_template"),
                   help="auto (the --tokenizer folder's template, else built-in), builtin, or a "
                        ".jinja file; as data.chat_template (default %(default)s)")
    p.add_argument("--min-pixels", type=int, default=None, help="image area bounds (default: family's)")
    p.add_argument("--max-pixels", type=int, default=None)
    p.add_argument("--max-image-pixels", type=int, default=None,
                   help="largest source image or video frame opened, width × height (default: "
                        "Pillow's decompression-bomb limit); as data.max_image_pixels")
    _add_media_root(p)


def _add_media_root(p: argparse.ArgumentParser) -> None:
    p.add_argument("--media-root", default=None,
                   help="folder every image/video path must resolve inside (default: the "
                        "JSONL file's folder); as data.media_root")


def _data_file(args: argparse.Namespace):
    """`args.data` with its media inside `--media-root` (a `DataFile`), or None without data."""
    from vlpack.data.media import DataFile

    return None if args.data is None else DataFile.of(args.data, args.media_root)


def _add_validate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="encode every sample in full and list every bad one")
    p.add_argument("data", help="DATA.jsonl (image paths relative to it), or a Hugging Face "
                                "dataset (a save_to_disk folder, .parquet or .arrow files)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="also list samples longer than this many tokens")
    _add_encoder_flags(p)
    p.add_argument("--workers", type=int, default=None,
                   help="encoding processes (default: the CPU count, at most 8)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run_validate)


def _data_section(args: argparse.Namespace, **packing):
    """The `data` section the encoder flags (and `packing`: data.* settings) describe, read
    from `args.data` (the built-in synthetic set when there is none)."""
    from vlpack.config import DataConfig
    from vlpack.data.sources import source_kind

    return DataConfig(source=source_kind(args.data) if args.data else "synthetic",
                      path=args.data, tokenizer=args.tokenizer, chat_template=args.chat_template,
                      min_pixels=args.min_pixels, max_pixels=args.max_pixels,
                      max_image_pixels=args.max_image_pixels, media_root=args.media_root,
                      **packing)


def _run_validate(args: argparse.Namespace) -> int:
    from vlpack.data.validate import validate_command

    return validate_command(_data_section(args), family=args.family, seq_len=args.seq_len,
                            workers=args.workers, as_json=args.json)


def _add_pack(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pack", help="pack a dataset into bins and report how well it packs")
    p.add_argument("data", nargs="?", default=None,
                   help="DATA.jsonl, or a Hugging Face dataset (a save_to_disk folder, "
                        ".parquet or .arrow files); default: the built-in synthetic dataset")
    from typing import get_args, get_type_hints

    from vlpack.config import DataConfig

    d = DataConfig()  # the defaults `vlpack train` packs with: `pack` with no flags predicts it
    hints = get_type_hints(DataConfig)
    algos = [a for a in get_args(hints["packing"]) if a != "none"]
    p.add_argument("--seq-len", type=int, default=d.seq_len,
                   help="tokens per bin (data.seq_len; default %(default)s)")
    p.add_argument("--algo", choices=algos, default=d.packing,
                   help="bin packing algorithm (data.packing; default %(default)s)")
    p.add_argument("--buffer", type=int, default=d.buffer_size,
                   help="samples per planning buffer (data.buffer_size; default %(default)s)")
    p.add_argument("--max-patches", type=int, default=d.max_patches,
                   help="ViT patches per bin (data.max_patches; default none)")
    p.add_argument("--overlong", choices=list(get_args(hints["overlong"])),
                   default=d.overlong, help="data.overlong (default %(default)s)")
    _add_encoder_flags(p)
    p.add_argument("--pad-to-multiple-of", type=int, default=d.pad_to_multiple_of,
                   help="align each sample's segment (data.pad_to_multiple_of; default "
                        "%(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run_pack)


def _run_pack(args: argparse.Namespace) -> int:
    from vlpack.data.report import pack_command

    if args.seq_len % args.pad_to_multiple_of:
        raise ValueError(f"--seq-len {args.seq_len} must be a multiple of --pad-to-multiple-of "
                         f"{args.pad_to_multiple_of}")
    d = _data_section(args, seq_len=args.seq_len, packing=args.algo, buffer_size=args.buffer,
                      max_patches=args.max_patches, overlong=args.overlong,
                      pad_to_multiple_of=args.pad_to_multiple_of)
    return pack_command(d, family=args.family, as_json=args.json)


def _add_check(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="prove packed == unpacked on a model",
                       epilog=_presets_epilog)
    p.add_argument("--model", default="tiny-qwen3_vl",
                   help="preset name (listed below) or HF checkpoint folder")
    p.add_argument("--backend", choices=["auto", "sdpa", "varlen", "flex"], default="auto")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--samples", type=int, default=4,
                   help="samples packed into the checked row (at least 2)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the synthetic samples (and of random weights)")
    p.add_argument("--data", default=None,
                   help="DATA.jsonl: your samples, encoded as vlpack train encodes them; synth: "
                        "the built-in synthetic receipts (images, videos), written once and "
                        "encoded the same way (default: a synthetic mix of token ids and pixels, "
                        "no encoder)")
    p.add_argument("--init", choices=["auto", "random"], default="auto",
                   help="auto: the folder's weights (presets are random); random: random "
                        "weights of the folder's config.json, seeded by --seed")
    p.add_argument("--cp", type=int, default=1,
                   help="split the packed row over N context-parallel ranks (run under "
                        "`torchrun --standalone --nproc-per-node N -m vlpack check ...`; "
                        "k·N processes: k data-parallel replicas, each checking its own row)")
    _add_media_root(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_run_check)


def _run_check(args: argparse.Namespace) -> int:
    from vlpack.check.command import check_command
    from vlpack.check.run import EXIT_COULD_NOT_RUN

    kw = dict(backend=args.backend, dtype=args.dtype, samples=args.samples, seed=args.seed,
              data=_data_file(args), weights=getattr(args, "init", "auto"), as_json=args.json)
    if args.cp == 1:
        return check_command(args.model, **kw)
    from vlpack.train.distributed.parallel import context_group, init_distributed, shutdown
    from vlpack.train.distributed.slurm import torchrun_env

    try:
        if args.cp < 1:
            raise ValueError(f"--cp must be >= 1, got {args.cp}")
        os.environ.update(torchrun_env(os.environ))  # srun's task variables as torchrun's
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world % args.cp:
            raise ValueError(f"context parallelism over {args.cp} ranks needs {args.cp} "
                             f"processes (or a multiple: data-parallel replicas of {args.cp} "
                             f"ranks each), found WORLD_SIZE={world}: run under `torchrun "
                             f"--standalone --nproc-per-node {args.cp} -m vlpack check ...`")
        context = context_group(init_distributed(args.cp))
    except ValueError as e:
        print(f"vlpack check could not run: {e}", file=sys.stderr)
        return EXIT_COULD_NOT_RUN
    try:
        return check_command(args.model, **kw, context=context, replicas=world // args.cp)
    finally:
        shutdown()


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="packed supervised fine-tuning", epilog=_presets_epilog)
    p.add_argument("config", nargs="?", default=None,
                   help=f"CONFIG.yaml or a recipe: {_recipes()} (default: tiny)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides (`vlpack config "
                                                "RECIPE` lists every key: type, default, docstring)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the run's memory plan per device (weights, gradients, optimizer "
                        "state, activations) and whether it fits, without building or training")
    p.add_argument("--device-memory", default=None, metavar="SIZE",
                   help="with --dry-run: plan for one GPU of this much memory instead of this "
                        "machine's device (e.g. 80GiB; an H100 80GB shows torch 79.2GiB, an "
                        "H200 139.7GiB), one vlpack keeps fla kernel configurations for, and "
                        "print what the run would choose there")
    p.add_argument("--quiet", action="store_true",
                   help="vlpack's log messages at WARNING and above only (rank 0 logs INFO by "
                        "default); the progress lines and the summary stay: "
                        "train.progress=false drops the progress lines")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default=None,
                   help="level of vlpack's messages on rank 0 (default: info; other ranks: warning)")
    p.set_defaults(func=_run_train)


def _add_config(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="every config key of a run: value, type, default, docstring")
    p.add_argument("config", nargs="?", default=None,
                   help=f"CONFIG.yaml or a recipe: {_recipes()} (default: tiny)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    p.add_argument("--key", default=None, help="only keys starting with this (e.g. optim. or train.log)")
    p.set_defaults(func=_run_config)


def _run_config(args: argparse.Namespace) -> int:
    from vlpack.config_keys import format_config

    print(format_config(_run_config_of(args), prefix=args.key))
    return 0


def _run_config_of(args: argparse.Namespace):
    """The run's `Config`: `args.config` (a YAML file or a recipe; default tiny) with the dotted
    `args.overrides` (`vlpack train key=value ...` names no config: its first word is one)."""
    from vlpack.config import load_config

    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config:
        config, overrides = None, [config, *overrides]
    return load_config(config or "tiny", overrides)


def _run_train(args: argparse.Namespace) -> int:
    from vlpack.train.command import train
    from vlpack.train.run.progress import setup_logging

    setup_logging(args.log_level, quiet=args.quiet)
    if args.device_memory is not None and not args.dry_run:
        raise ValueError("--device-memory plans a card this machine does not have: add --dry-run")
    size = None if args.device_memory is None else parse_size(args.device_memory, "--device-memory")
    return train(_run_config_of(args), dry_run=args.dry_run, device_memory=size)


_UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_size(text: str, what: str) -> int:
    """Bytes of a size such as `80GiB`, `79.2gib` or `80GB` (GB = 10⁹ bytes, GiB = 2³⁰); a unit
    is required."""
    import re

    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"{what} {text!r}: give a size with its unit, such as 80GiB (2^30 "
                         "bytes) or 80GB (10^9 bytes)")
    return int(float(m.group(1)) * _UNITS[unit])


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="a run's checkpoint as a folder transformers and serving "
                                      "engines load")
    p.add_argument("source", metavar="RUN_OR_CHECKPOINT",
                   help="a run folder (its latest checkpoint) or OUTPUT_DIR/checkpoints/step_N")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--hf", action="store_true",
                      help="a transformers folder, LoRA folded in (the default)")
    kind.add_argument("--adapter", action="store_true",
                      help="a LoRA run's adapter in peft's format")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="dtype of the exported weights and of config.json's dtype")
    p.add_argument("--out", default=None,
                   help="output folder (default: RUN/export/step_N-hf or step_N-adapter)")
    p.add_argument("--max-shard-size", default="5GB",
                   help="largest safetensors shard, e.g. 5GB or 500MB (default 5GB)")
    p.set_defaults(func=_run_export)


def _run_export(args: argparse.Namespace) -> int:
    import logging

    from vlpack.train.run.export import export_checkpoint, parse_size

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    export_checkpoint(args.source, args.out, mode="adapter" if args.adapter else "hf",
                      out_dtype=args.dtype, max_shard_bytes=parse_size(args.max_shard_size))
    return 0


def _add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="generate the answers of held-out conversations and score "
                                    "them (exact match, token F1, JSON fields)")
    p.add_argument("source", metavar="RUN_OR_CHECKPOINT",
                   help="a run folder (its latest checkpoint, else its hf/ export), "
                        "OUTPUT_DIR/checkpoints/step_N, or an exported folder")
    p.add_argument("--data", required=True,
                   help="DATA.jsonl in the messages or ShareGPT shape; every supervised "
                        "assistant turn is generated from the conversation before it")
    p.add_argument("--out", default=None,
                   help="folder for predictions.jsonl and metrics.json (default: SOURCE/eval)")
    p.add_argument("--max-new-tokens", type=int, default=256,
                   help="longest answer generated (default 256)")
    p.add_argument("--batch-size", type=int, default=8,
                   help="prompts generated together, left-padded (default 8)")
    p.add_argument("--limit", type=int, default=None, help="only the first N conversations")
    _add_media_root(p)
    p.set_defaults(func=_run_eval)


def _run_eval(args: argparse.Namespace) -> int:
    import logging

    from vlpack.train.run.generate import evaluate

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    evaluate(args.source, _data_file(args), args.out, max_new_tokens=args.max_new_tokens,
             prompts_per_batch=args.batch_size, limit=args.limit)
    return 0


def _add_plot(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="overlay loss curves of runs")
    p.add_argument("runs", nargs="+", help="run folders holding metrics.jsonl")
    p.add_argument("--out", default=None, help="PNG path (default: first run's folder)")
    p.add_argument("--metrics", default="loss",
                   help="comma list of per-step metrics, one panel each (e.g. "
                        "loss,lr,grad_norm,tokens_per_s,memory,aux_loss; memory draws allocated "
                        "and reserved); default: loss")
    p.add_argument("--x", default="samples", choices=("samples", "step"),
                   help="horizontal axis: samples seen (default) or step")
    p.set_defaults(func=_run_plot)


def _run_plot(args: argparse.Namespace) -> int:
    from vlpack.train.run.plot import plot_runs

    out = args.out or Path(args.runs[0]) / "loss_overlay.png"
    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
    print(f"wrote {plot_runs(args.runs, out, x=args.x, metrics=metrics)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="vlpack", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    data = sub.add_parser("data", help="dataset tools")
    data = data.add_subparsers(dest="data_cmd", required=True)
    _add_synth(data)
    _add_energon_prepare(data)
    _add_validate(data)
    _add_pack(sub)
    _add_check(sub)
    _add_train(sub)
    _add_config(sub)
    _add_export(sub)
    _add_eval(sub)
    _add_plot(sub)
    return parser


def _train_flags_first(argv: list[str]) -> list[str]:
    """`vlpack train RECIPE key=value --dry-run key=value`: the flags of `train` before its
    positional arguments (argparse does not take flags between the parts of a `*` list)."""
    if not argv or argv[0] != "train":
        return argv
    flags, positional, rest = [], [], iter(argv[1:])
    for a in rest:
        if a.startswith("--"):
            flags.append(a)
            if a in VALUED_TRAIN_FLAGS:  # `--log-level debug`: its value moves with it
                flags.append(next(rest, ""))
        else:
            positional.append(a)
    return ["train", *flags, *positional]


VALUED_TRAIN_FLAGS = ("--log-level", "--device-memory")
"""`vlpack train` flags written with a separate value."""


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `vlpack` console script."""
    args = build_parser().parse_args(_train_flags_first(sys.argv[1:] if argv is None else argv))
    # A user's bad config or data surfaces as a ValueError whose message names the fix;
    # VLPACK_TRACEBACK=1 shows the traceback instead.
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        if os.environ.get("VLPACK_TRACEBACK"):
            raise
        print(f"vlpack: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
