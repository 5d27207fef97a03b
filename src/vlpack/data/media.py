"""Media files a dataset names: where they may live, and opening images as training does.

Path policy: a media path (image, video file, video frame) is joined to the JSONL file's folder
unless absolute, then resolved (`..` and symlinks followed). The resolved file must lie inside
the media root: `data.media_root` when set, else the JSONL file's own folder. A path that
escapes is refused by name as `media_outside_root`, before any byte is read. Shards and
training read only what the dataset names, so a dataset from elsewhere cannot pull
`/etc/passwd`, `~/.ssh/...` or another project's files into a model or a shard. A path that
exists must be a regular file (not a folder, FIFO or device), and one the OS cannot check (a
name too long, a NUL byte, a symlink loop, no permission) is refused as `bad_media_path`, as is
an inline `data:` URI (named as one, with the fix: the image as a file beside the JSONL). The
resolved path is what every later open uses, so the file read is the file checked. A
`DataFile` carries a data file with its root, so every reader of the file bounds its media alike.

Formats: images are opened only as the raster formats of `IMAGE_FORMATS` (no EPS, which Pillow
hands to Ghostscript, nor any other format it can identify).
"""

from __future__ import annotations

import io
import stat
from dataclasses import dataclass, field
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

BAD_PATH = "bad_media_path"
"""The skip reason of a media path the OS cannot check, or that names no regular file."""

IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
"""The Pillow formats vlpack opens images and video frames as; any other file, whatever its
name, is a bad image. JPEG includes the MPO files many phones write (Pillow's JPEG opener
returns them; "MPO" itself has no opener and may not be listed)."""


@dataclass(frozen=True)
class DataFile:
    """A data file and the folder its media must resolve inside: a JSONL file or a Hugging Face
    dataset (a folder, or a .parquet/.arrow file), with `data.media_root` (`--media-root`).
    Built once from the config or the command line (`of`); a mixture builds one per source,
    each with the shared `data.media_root`, so each source's default root is its own folder."""

    path: Path
    """The data file, or the dataset's folder, as given (messages name it so)."""
    media_root: Path | None = None
    """The media root as given; None: the file's folder."""
    folder: Path = field(init=False, repr=False, compare=False)
    """The folder relative media paths are joined to (absolute): the file's folder, or the path
    itself when it is a folder."""
    root: Path = field(init=False, repr=False, compare=False)
    """The folder every media path must resolve inside: `media_root`, else `folder`, resolved
    when the value is built (`..` and symlinks followed, a relative root against the working
    directory of that moment)."""

    def __post_init__(self) -> None:
        folder = (self.path if self.path.is_dir() else self.path.parent).absolute()
        object.__setattr__(self, "folder", folder)
        root = folder if self.media_root is None else self.media_root
        object.__setattr__(self, "root", root.resolve())

    @classmethod
    def of(cls, path: str | Path | DataFile, media_root: str | Path | None = None) -> DataFile:
        """`path` with its media inside `media_root` (None: the file's folder); a `DataFile`
        is returned as it is (it holds its own root)."""
        if isinstance(path, DataFile):
            if media_root is not None:
                raise ValueError(f"{path.path} already has its media root: build the DataFile "
                                 "with the root, not beside it")
            return path
        return cls(Path(path), None if media_root is None else Path(media_root))

    def media(self, raw: str, key: str, what: str) -> Path:
        """`media_path` of the path `raw` that the record `key` names: joined to `folder`,
        inside `root`."""
        return media_path(raw, self.folder, self.root, key, what)


def media_path(raw: str, base: Path, root: Path, key: str, what: str) -> Path:
    """`base / raw` resolved (through `..` and symlinks), refused with
    `BadSampleError(OUTSIDE_ROOT)` when that lies outside `root` (itself already resolved), and
    with `BadSampleError(BAD_PATH)` when the OS cannot check it or it exists but is not a regular
    file, or is an inline `data:` URI. A path that does not exist is returned; its reader
    reports it missing."""
    if raw.startswith("data:"):  # the bytes inline (base64), not a path
        kind = raw[5:].split(";")[0].split(",")[0]  # e.g. image/png
        sub = kind.partition("/")[2] or ("png" if what == "image" else "mp4")
        ext = {"jpeg": "jpg"}.get(sub, sub)
        raise BadSampleError(
            BAD_PATH, f"{key}: {what} {raw[:40] + '…'!r} is an inline data: URI, which vlpack "
            f"does not read: write the {what} to a file next to the JSONL file and name that file "
            f'in the record (e.g. "{what}s/0001.{ext}")')
    try:
        real = (base / raw).resolve()
    except (ValueError, OSError, RuntimeError) as e:  # a NUL byte, a symlink loop
        raise BadSampleError(
            BAD_PATH, f"{key}: {what} {_shown(raw)} is not a usable path ({e}): fix the record"
        ) from None
    if not real.is_relative_to(root):
        raise BadSampleError(
            OUTSIDE_ROOT,
            f"{key}: {what} {raw!r} resolves to {real}, outside the media root {root} (media "
            "files must lie inside data.media_root, by default the JSONL file's folder): move "
            "the file under it, or set data.media_root to a folder that holds every media file "
            "(--media-root for vlpack pack, check, data validate and data energon-prepare)",
        )
    try:
        mode = real.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return real
    except OSError as e:  # a name too long, no permission
        raise BadSampleError(BAD_PATH, f"{key}: {what} {_shown(raw)} cannot be checked "
                             f"({e.strerror}): fix the path in the record") from None
    if not stat.S_ISREG(mode):  # a FIFO would block the reader, a device never end
        raise BadSampleError(BAD_PATH, f"{key}: {what} {_shown(raw)} is not a regular file (a "
                             "folder, FIFO or device): name an image or video file")
    return real


def _shown(raw: str) -> str:
    """`raw` quoted for a message, its middle elided past 120 characters."""
    return repr(raw) if len(raw) <= 120 else f"{raw[:60]!r}...{raw[-40:]!r} ({len(raw)} chars)"


def open_raster(file: Path | io.BytesIO) -> PILImage.Image:
    """`file` opened lazily by Pillow as one of `IMAGE_FORMATS` (UnidentifiedImageError for any
    other format)."""
    from PIL import Image

    return Image.open(file, formats=IMAGE_FORMATS)


PILLOW_LIMIT = 2 * (1024 * 1024 * 1024 // 4 // 3)
"""Pixels above which Pillow refuses an image by default (twice its default MAX_IMAGE_PIXELS,
about 179 M): the limit when `data.max_image_pixels` is None."""


def pixel_limit(max_image_pixels: int | None) -> int:
    """The largest width × height an image or a video frame may have."""
    return PILLOW_LIMIT if max_image_pixels is None else max_image_pixels


def image_limit(max_image_pixels: int | None) -> None:
    """Make Pillow refuse exactly the images above `max_image_pixels` (it errors above twice its
    MAX_IMAGE_PIXELS and warns above it; vlpack keeps the error and drops the warning). None
    restores Pillow's default, which an earlier encoder's limit may have replaced (Pillow holds
    it process-wide)."""
    from PIL import Image

    if max_image_pixels is None:
        Image.MAX_IMAGE_PIXELS = PILLOW_LIMIT // 2
        return
    import warnings

    Image.MAX_IMAGE_PIXELS = max_image_pixels // 2
    warnings.simplefilter("ignore", Image.DecompressionBombWarning)


def open_image(key: str, ref: ImageRef, max_image_pixels: int | None = None) -> PILImage.Image:
    """Open and decode an image upright, as transformers' `load_image` does (its EXIF
    orientation applied with `ImageOps.exif_transpose`), turning I/O and format errors into
    BadSampleError."""
    from PIL import Image, ImageOps

    image_limit(max_image_pixels)
    try:
        image = open_raster(_file(ref))
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

    image_limit(max_image_pixels)
    try:
        with open_raster(_file(ref)) as image:
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
        "PNG/JPEG (vlpack reads JPEG, PNG, WebP, GIF, BMP and TIFF) or drop the sample",
    )
