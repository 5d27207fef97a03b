"""Synthetic receipts: a small, offline, deterministic SFT dataset in the spirit of CORD.

Each sample shows one or two receipts rendered with PIL (shop, address, date, items with
quantity and price, subtotal, tax, total) and asks for the receipt as JSON. Sizes range from
300×400 to 1000×1600 px, so vision tokens span ~100 to ~2,000 at the default max_pixels. About
15% each are multi-turn, two-receipt and text-only samples, ~30% carry a system prompt, and
~20% are written in the ShareGPT shape (the rest in the messages shape). About 10% of the
single-receipt samples are short videos instead: the receipt revealed line by line over 4-8
frames (a frame folder at 1, 2 or 3 fps by the sample's index, so videos of several frame rates
exercise Qwen2.5-VL's `second_per_grid`; at most 320 px wide), asking for the receipt as it
ends. Output for a seed is byte-identical: the JSONL, the image and the frame files.
"""

from __future__ import annotations

import contextlib
import functools
import json
import multiprocessing
import os
import random
import shutil
import uuid
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

SYNTH_VERSION = "3"
_SHOP_A = ("Golden", "Happy", "Blue", "Corner", "Sunny", "Little", "Royal", "Green", "Lucky",
           "Urban", "Old Town", "Maple")  # fmt: skip
_SHOP_B = ("Bakery", "Cafe", "Noodle House", "Grill", "Mart", "Deli", "Kitchen", "Tea Room",
           "Pizzeria", "Diner", "Sushi Bar", "Bistro")  # fmt: skip
_STREETS = ("Main St", "Oak Ave", "Harbor Rd", "King St", "Elm St", "Park Lane", "Mill Rd",
            "River Way", "Station Sq", "Hill St")  # fmt: skip
_CITIES = ("Springfield", "Riverton", "Lakeside", "Fairview", "Greenville", "Bayview")
_ITEMS = ("Americano", "Latte", "Croissant", "Bagel", "Green Tea", "Fried Rice", "Ramen",
          "Dumplings", "Caesar Salad", "Cheeseburger", "Fries", "Iced Tea", "Muffin", "Pad Thai",
          "Margherita", "Espresso", "Cola", "Miso Soup", "Salmon Roll", "Brownie", "Pancakes",
          "Orange Juice", "Club Sandwich", "Tomato Soup")  # fmt: skip
FPS = (1, 2, 3)
"""The frame rates of the videos, cycled by sample index."""
_SYSTEM = ("You are a meticulous assistant that reads receipts.",
           "You extract structured data from documents. Answer with JSON only.",
           "You are a helpful bookkeeping assistant.")  # fmt: skip
_ASK = ("Extract this receipt as JSON.", "Read the receipt and return its fields as JSON.",
        "Transcribe the receipt into JSON with shop, address, date, items and totals.")  # fmt: skip


WRITTEN = ("data.jsonl", "images", "videos")
"""What `write_synthetic` writes in its folder."""


def write_synthetic(out_dir: str | Path, n: int, seed: int = 0, show_progress: bool = False,
                    workers: int | None = None, overwrite: bool = False) -> Path:
    """Write `n` samples to `out_dir/data.jsonl` and `out_dir/images/` (and `videos/`); returns
    the JSONL path. A folder that already holds any of those is refused (ValueError), unless
    `overwrite`: then they are deleted first, and nothing else in the folder is touched.
    Samples render in `workers` processes (default for 256 samples or more: up to 8, sharing
    the cores with the other ranks of a torchrun node, which generate the same data; else
    none); each sample depends only on (seed, index), so the output is the same either way."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    out = Path(out_dir)
    held = [p for p in (out / name for name in WRITTEN)
            if p.is_symlink() or p.is_file() or (p.is_dir() and any(p.iterdir()))]
    if held and not overwrite:
        raise ValueError(f"{out} already holds {', '.join(p.name for p in held)}: the synthetic "
                         "dataset would replace them. Write it to another folder, or delete "
                         "them first with `vlpack data synth --overwrite`")
    for p in held:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    (out / "images").mkdir(parents=True, exist_ok=True)
    if workers is None:
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        workers = max(1, min(8, (os.cpu_count() or 1) // ranks)) if n >= 256 else 1
    make = functools.partial(_sample, out, seed)
    with contextlib.ExitStack() as stack:
        if workers > 1:  # spawned: the caller may hold threads or a GPU context
            pool = stack.enter_context(ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("spawn")))
            samples: Any = pool.map(make, range(n), chunksize=32)
        else:
            samples = map(make, range(n))
        if show_progress:
            from tqdm import tqdm

            samples = tqdm(samples, total=n, desc="synth", unit="sample")
        lines = [json.dumps(s, ensure_ascii=False) for s in samples]
    path = out / "data.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def default_dataset(n: int = 256, seed: int = 0) -> Path:
    """The built-in dataset's JSONL path, generated once into `$VLPACK_CACHE` (default
    `~/.cache/vlpack`) as `synth-n{n}-s{seed}/` and reused; safe for parallel processes."""
    root = Path(os.environ.get("VLPACK_CACHE", Path.home() / ".cache" / "vlpack"))
    final = root / f"synth-n{n}-s{seed}"
    marker = final / ".complete"
    if marker.is_file() and marker.read_text() == SYNTH_VERSION:
        return final / "data.jsonl"
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        write_synthetic(tmp, n=n, seed=seed)
        (tmp / ".complete").write_text(SYNTH_VERSION)
        if final.exists() and not (marker.is_file() and marker.read_text() == SYNTH_VERSION):
            shutil.rmtree(final, ignore_errors=True)  # stale version or an interrupted copy
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first: use its copy
            if not marker.is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final / "data.jsonl"


# ------------------------------------------------------------------------- receipts


def _receipt(rng: random.Random) -> dict[str, Any]:
    items = []
    for _ in range(rng.randint(2, 10)):
        qty = rng.choice((1, 1, 1, 2, 2, 3, 4))
        price = rng.randint(150, 2500)  # cents
        items.append({"name": rng.choice(_ITEMS), "qty": qty, "price": _money(qty * price)})
    subtotal = sum(int(it["price"].replace(".", "")) for it in items)
    tax = subtotal * rng.choice((0, 5, 8, 10)) // 100
    return {
        "shop": f"{rng.choice(_SHOP_A)} {rng.choice(_SHOP_B)}",
        "address": f"{rng.randint(1, 999)} {rng.choice(_STREETS)}, {rng.choice(_CITIES)}",
        "date": f"{rng.randint(2019, 2025)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
        "items": items,
        "subtotal": _money(subtotal),
        "tax": _money(tax),
        "total": _money(subtotal + tax),
    }


def _money(cents: int) -> str:
    return f"{cents // 100}.{cents % 100:02d}"


def _lines(r: dict[str, Any]) -> list[str]:
    lines = [r["shop"].upper(), r["address"], f"Date: {r['date']}", "-" * 24]
    lines += [f"{it['qty']} x {it['name']}  {it['price']}" for it in r["items"]]
    lines += ["-" * 24, f"SUBTOTAL  {r['subtotal']}", f"TAX  {r['tax']}",
              f"TOTAL  {r['total']}", "THANK YOU!"]  # fmt: skip
    return lines


@functools.lru_cache(maxsize=64)
def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


def _render(r: dict[str, Any], rng: random.Random, shown: int | None = None) -> Image.Image:
    """A receipt image between 300×400 and 1000×1600 px (only its first `shown` lines)."""
    width = rng.randint(300, 1000)
    height = min(1600, max(400, int(width * rng.uniform(1.3, 1.7))))
    shade = rng.randint(235, 255)
    image = Image.new("RGB", (width, height), (shade, shade, rng.randint(225, shade)))
    draw = ImageDraw.Draw(image)
    lines = _lines(r)
    size = max(10, min(width // 22, int(height / (len(lines) + 4) / 1.3)))
    font, ink = _font(size), (rng.randint(0, 60),) * 3
    y, margin = size * 2, width // 12
    for line in lines[:shown]:
        draw.text((margin, y), line, fill=ink, font=font)
        y += int(size * 1.3)
    return image


# ------------------------------------------------------------------------- samples


def _sample(out: Path, seed: int, i: int) -> dict[str, Any]:
    rng = random.Random(seed * 1_000_003 + i)
    kind = rng.choices(("single", "multi_turn", "two_images", "text_only"), (55, 15, 15, 15))[0]
    # its own stream, so the other samples stay those of a dataset without videos
    video_rng = random.Random(seed * 1_000_003 + i + 0x5EED)
    if kind == "single" and video_rng.random() < 0.1:
        return _video_sample(out, seed, i, video_rng)
    receipts = [_receipt(rng) for _ in range(2 if kind == "two_images" else 1)]
    images = []
    if kind != "text_only":
        ext = "png" if rng.random() < 0.2 else "jpg"
        for j, r in enumerate(receipts):
            name = f"images/{i:06d}_{j}.{ext}"
            _render(r, rng).save(out / name, **({"quality": 85} if ext == "jpg" else {}))
            images.append(name)
    turns: list[tuple[str, str]] = []  # (role, text); "<image>" marks where images go
    if rng.random() < 0.3:
        turns.append(("system", rng.choice(_SYSTEM)))
    answer = json.dumps(receipts[0] if len(receipts) == 1 else receipts, ensure_ascii=False)
    if kind == "text_only":
        turns.append(("user", rng.choice(_ASK) + "\n\n" + "\n".join(_lines(receipts[0]))))
    elif kind == "two_images":
        turns.append(("user", "<image><image>Extract both receipts as a JSON list, in order."))
    else:
        turns.append(("user", "<image>" + rng.choice(_ASK)))
    turns.append(("assistant", answer))
    if kind == "multi_turn":
        turns.append(("user", "What is the total amount?"))
        turns.append(("assistant", f"The total is {receipts[0]['total']}."))
        if rng.random() < 0.5:
            turns.append(("user", "How many different items were bought?"))
            turns.append(("assistant", str(len(receipts[0]["items"]))))
    record: dict[str, Any] = {"id": f"synth-s{seed}-{i:06d}"}
    if rng.random() < 0.2:
        names = {"system": "system", "user": "human", "assistant": "gpt"}
        record["conversations"] = [{"from": names[r], "value": t} for r, t in turns]
        if images:
            record["images"] = images
    else:
        record["messages"] = [_message(role, text, images) for role, text in turns]
    return record


def _video_sample(out: Path, seed: int, i: int, rng: random.Random) -> dict[str, Any]:
    """A receipt revealed line by line: 4-8 frames in `videos/{i}/` at `FPS[i % 3]`, asked
    about at the end."""
    receipt = _receipt(rng)
    n_frames = rng.randint(4, 8)
    total_lines = len(_lines(receipt))
    folder = out / "videos" / f"{i:06d}"
    folder.mkdir(parents=True, exist_ok=True)
    layout = rng.random()  # one size, shade and ink for every frame
    frames = []
    for k in range(n_frames):
        shown = max(1, round(total_lines * (k + 1) / n_frames))
        image = _render(receipt, random.Random(layout), shown)
        scale = min(1.0, 320 / image.width)
        image = image.resize((max(1, int(image.width * scale)), max(1, int(image.height * scale))))
        name = f"videos/{i:06d}/{k:02d}.jpg"
        image.save(out / name, quality=85)
        frames.append(name)
    ask = "Watch the receipt being written and return it as JSON once it is complete."
    return {"id": f"synth-s{seed}-{i:06d}", "messages": [
        {"role": "user", "content": [{"type": "video", "video": frames, "fps": FPS[i % len(FPS)]},
                                     {"type": "text", "text": ask}]},
        {"role": "assistant", "content": json.dumps(receipt, ensure_ascii=False)}]}


def _message(role: str, text: str, images: list[str]) -> dict[str, Any]:
    if "<image>" not in text:
        return {"role": role, "content": text}
    content: list[dict[str, str]] = [
        {"type": "image", "image": images[k]} for k in range(text.count("<image>"))
    ]
    content.append({"type": "text", "text": text.replace("<image>", "")})
    return {"role": role, "content": content}
