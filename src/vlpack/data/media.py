"""Media files a dataset names: where they may live, and opening images as training does.

Path policy: a media path (image, video file, video frame) is joined to the JSONL file's folder
unless absolute, then resolved (`..` and symlinks followed). The resolved file must lie inside
the media root: `data.media_root` when set, else the JSONL file's own folder. A path that
escapes is refused by name as `media_outside_root`, before any byte is read. Shards and
training read only what the dataset names, so a dataset from elsewhere cannot pull
`/etc/passwd`, `~/.ssh/...` or another project's files into a model or a shard.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING

from vlpack.data.types import BadSampleError, ImageRef

if TYPE_CHECKING:
    from PIL import Image as PILImage

ORIENTATION = 0x0112
"""The EXIF tag of the orientation; values 5-8 turn the image by 90 degrees (width and height
swap)."""

OUTSIDE_ROOT = "media_outside_root"
"""The skip reason of a media path that resolves outside the media root."""


def media_path(raw: str, base: Path, root: Path, key: str, what: str) -> Path:
    """`base / raw`, refused with `BadSampleError(OUTSIDE_ROOT)` when it resolves (through `..`
    and symlinks) outside `root` (itself already resolved)."""
    path = base / raw
    try:
        real = path.resolve()
    except (ValueError, OSError, RuntimeError) as e:  # a NUL byte, a symlink loop
        raise BadSampleError(
            OUTSIDE_ROOT, f"{key}: {what} {raw!r} is not a usable path ({e}): fix the record"
        ) from None
    if not real.is_relative_to(root):
        raise BadSampleError(
            OUTSIDE_ROOT,
            f"{key}: {what} {raw!r} resolves to {real}, outside the media root {root} (media "
            "files must lie inside data.media_root, by default the JSONL file's folder): move "
            "the file under it, or set data.media_root to a folder that holds every media file "
            "(--media-root for vlpack pack, check, data validate and data energon-prepare)",
        )
    return path


def _image_limit(max_image_pixels: int | None) -> None:
    """Make Pillow refuse exactly the images above `max_image_pixels` (it errors above twice its
    MAX_IMAGE_PIXELS and warns above it; vlpack keeps the error and drops the warning)."""
    if max_image_pixels is None:
        return
    import warnings

    from PIL import Image

    Image.MAX_IMAGE_PIXELS = max_image_pixels // 2
    warnings.simplefilter("ignore", Image.DecompressionBombWarning)


def open_image(key: str, ref: ImageRef, max_image_pixels: int | None = None) -> PILImage.Image:
    """Open and decode an image upright, as transformers' `load_image` does (its EXIF
    orientation applied with `ImageOps.exif_transpose`), turning I/O and format errors into
    BadSampleError."""
    from PIL import Image, ImageOps

    _image_limit(max_image_pixels)
    try:
        image = Image.open(_file(ref))
        image.load()  # decode now so a truncated or corrupt file fails here
        return ImageOps.exif_transpose(image)
    except FileNotFoundError:
        raise _missing(key, ref) from None
    except Image.DecompressionBombError as e:
        raise _too_large(key, ref, e) from None
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, ... on bad data
        raise _corrupt(key, ref, e) from None


def image_size(key: str, ref: ImageRef, max_image_pixels: int | None = None) -> tuple[int, int]:
    """(width, height) of the upright image (`open_image`'s size) from the header, without
    decoding pixels: swapped when the EXIF orientation turns it by 90 degrees."""
    from PIL import Image

    _image_limit(max_image_pixels)
    try:
        with Image.open(_file(ref)) as image:
            # Image.getexif reads what the header gave; PNG's override would decode the pixels
            turned = Image.Image.getexif(image).get(ORIENTATION, 1) in (5, 6, 7, 8)
            width, height = image.size
            return (height, width) if turned else (width, height)
    except FileNotFoundError:
        raise _missing(key, ref) from None
    except Image.DecompressionBombError as e:
        raise _too_large(key, ref, e) from None
    except Exception as e:
        raise _corrupt(key, ref, e) from None


def _file(ref: ImageRef) -> Path | io.BytesIO:
    """What Pillow opens: the file, or the bytes a dataset holds (the same checks apply)."""
    return ref.path if ref.data is None else io.BytesIO(ref.data)


def _missing(key: str, ref: ImageRef) -> BadSampleError:
    return BadSampleError(
        "missing_image",
        f"{key}: image {ref.path} not found: fix the path (relative paths are resolved against "
        "the JSONL file's folder) or drop the sample",
    )


def _too_large(key: str, ref: ImageRef, e: Exception) -> BadSampleError:
    return BadSampleError(
        "image_too_large",
        f"{key}: image {ref.path} is larger than the decompression-bomb limit ({e}); downscale "
        "it, or if you trust the file raise the limit: data.max_image_pixels=N (`vlpack pack` "
        "and `vlpack data validate`: --max-image-pixels N)",
    )


def _corrupt(key: str, ref: ImageRef, e: Exception) -> BadSampleError:
    return BadSampleError(
        "corrupt_image",
        f"{key}: image {ref.path} cannot be read ({type(e).__name__}: {e}): re-export it as "
        "PNG/JPEG or drop the sample",
    )
