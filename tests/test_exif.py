"""EXIF orientation: a phone photo stored 300×200 with orientation 6 trains upright, as
transformers' `load_image` gives it, and every length measured from its header follows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vlpack.data.encode import Encoder
from vlpack.data.media import ORIENTATION
from vlpack.data.types import BadSampleError, Conversation, ImageRef, Message


def _photo(path: Path, orientation: int, fmt: str = "JPEG") -> Path:
    """A 300×200 picture, left half red, with the EXIF orientation `orientation`."""
    a = np.zeros((200, 300, 3), np.uint8)
    a[:, :150, 0] = 255
    exif = Image.Exif()
    exif[ORIENTATION] = orientation
    Image.fromarray(a).save(path, format=fmt, exif=exif.tobytes())
    return path


def _conv(path: Path) -> Conversation:
    return Conversation("k", (Message("user", (ImageRef(path), "Which side is red?")),
                              Message("assistant", ("left",))))


@pytest.fixture(scope="module")
def enc() -> Encoder:
    return Encoder("qwen3_vl", min_pixels=16384, max_pixels=50176)


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_encoded_as_transformers_loads_it(enc: Encoder, tmp_path: Path, orientation: int) -> None:
    from transformers.image_utils import load_image

    path = _photo(tmp_path / "p.jpg", orientation)
    upright = load_image(str(path))  # transformers: exif_transpose, then RGB
    assert upright.size == ((200, 300) if orientation in (6, 8) else (300, 200))
    ref = enc.image_processor(images=[upright], return_tensors=None)
    s = enc.encode(_conv(path))
    assert s.image_grid_thw.tolist() == np.asarray(ref["image_grid_thw"]).tolist()
    np.testing.assert_array_equal(s.pixel_values, np.asarray(ref["pixel_values"], np.float32))
    assert enc.measure(_conv(path)) == s.size  # the header's size is the upright one


def test_png_with_exif_in_its_header(enc: Encoder, tmp_path: Path) -> None:
    path = _photo(tmp_path / "p.png", 6, fmt="PNG")
    s = enc.encode(_conv(path))
    _, h, w = s.image_grid_thw[0].tolist()
    assert h > w and enc.measure(_conv(path)) == s.size


def test_orientation_known_only_after_the_pixels_is_refused(enc: Encoder, tmp_path: Path) -> None:
    """A PNG whose eXIf chunk follows the pixel data: its header size is not its upright size,
    so the encoder refuses it rather than overfill a bin planned from the header."""
    import struct
    import zlib

    path = _photo(tmp_path / "late.png", 1, fmt="PNG")
    Image.open(path).save(path, format="PNG")  # no EXIF at all
    data = path.read_bytes()
    exif = Image.Exif()
    exif[ORIENTATION] = 6
    body = exif.tobytes()[6:] if exif.tobytes().startswith(b"Exif\0\0") else exif.tobytes()
    chunk = struct.pack(">I", len(body)) + b"eXIf" + body + struct.pack(
        ">I", zlib.crc32(b"eXIf" + body))
    iend = data.rindex(b"IEND") - 4
    path.write_bytes(data[:iend] + chunk + data[iend:])
    with Image.open(path) as im:  # Pillow sees the orientation only once it has decoded
        im.load()
        assert im.getexif().get(ORIENTATION) == 6
    with pytest.raises(BadSampleError, match="stored after the pixel data") as info:
        enc.encode(_conv(path))
    assert info.value.reason == "corrupt_image"
