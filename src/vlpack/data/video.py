"""Videos: which frames, at what size, as which patches — each family's video processor's rules.

A video is a container file (mp4, webm, ...; decoded with PyAV, the `video` extra) or a list of
frame images (a video already sampled at its `fps`, default 2; no decoder needed). The rules
follow transformers' video processors, checked against them (tests/data/test_video.py):

- **Frames.** A file is sampled to `fps` frames per second of its duration, clamped to
  `[min_frames, max_frames]` and to its frame count. qwen2_vl / qwen2_5_vl
  (`Qwen2VLVideoProcessor.sample_frames`): the count is floored to an even number and the
  frames are taken at a uniform stride from frame 0; qwen3_vl / qwen3_5
  (`Qwen3VLVideoProcessor.sample_frames`): evenly from the first to the last frame. A frame list
  keeps all its frames.
- **Size.** Every frame of a video is resized to one size: qwen2 families bound each frame's
  area (`smart_resize` over height × width), qwen3 families the whole clip's (frames × height
  × width). With `cap_pixels_per_frame` (on by default, qwen-vl-utils' rule and transformers'
  `cap_pixels_per_frame=True`) the budget is also shared out over the frames, so a long clip
  costs tokens in proportion to its length rather than all of `max_pixels` per frame.
- **Patches.** Bicubic, antialiased resize of the uint8 frames (the kernel torchvision runs on
  a CPU), rescale and normalise as for images, the last frame repeated to an even count, then
  patches of 2 frames × patch²; grid (t, h, w) = (frames / 2, height / patch, width / patch).
- **Time.** qwen2_5_vl spaces temporal positions by `second_per_grid` = 2 / sampled fps (the
  processor's `second_per_grid_ts`); qwen3 families write a `<{seconds:.1f} seconds>` text
  before each temporal patch (the mean time of its two frames); qwen2_vl uses neither.

Everything but the pixels is known from the container's metadata or the first frame's header
(`plan`), so the planner sees a video's exact length without decoding it.

Untrusted files: a video file is opened only as one of the single-file containers of
`VIDEO_CONTAINERS` (`open_container`), never as a playlist, concat list or image pattern that
would make FFmpeg read further files; frames are opened as the image formats of
`vlpack.data.media.IMAGE_FORMATS`. A video whose frames exceed the pixel limit images have
(`data.max_image_pixels`) or a frame list longer than `max_frames` is refused from its header
(`video_too_large`), and each frame is resized as soon as it is decoded, so decoding holds one
full-size frame at a time.

Legend: F = frames, H/W = pixels, P = patches, C = 3 × temporal patch × patch².
"""

from __future__ import annotations

import io
import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vlpack.config import VideoSettings
from vlpack.data.media import image_limit, open_raster, pixel_limit
from vlpack.data.processor import read_processor_config
from vlpack.data.types import BadSampleError, VideoRef
from vlpack.families import family as family_of

FRAME_LIST_FPS = 2.0
"""Frame rate of a frame list that names none (what qwen-vl-utils assumes)."""

VIDEO_CONTAINERS = "mov,mp4,m4a,3gp,3g2,mj2,matroska,webm,avi,mpegts,flv"
"""The FFmpeg demuxers a video file is opened with: single-file containers only. Left to guess,
FFmpeg also opens HLS playlists, concat lists and image patterns (`seq%d.png`), which read other
files, unchecked by the media-root policy."""

UNSUPPORTED = "unsupported_video"
"""The skip reason of a video file in no container of `VIDEO_CONTAINERS`."""

TOO_LARGE = "video_too_large"
"""The skip reason of a video whose frames exceed the image pixel limit, or of a frame list
longer than `max_frames`."""


DEFAULTS = VideoSettings(fps=2.0, min_frames=4, max_frames=768, cap_pixels_per_frame=True)
"""The family processors' sampling defaults (`cap_pixels_per_frame`: qwen-vl-utils' rule,
transformers' announced default)."""


def folder_settings(folder: str | Path, family: str) -> tuple[VideoSettings, str] | None:
    """The video settings a HF checkpoint folder saved in `video_preprocessor_config.json`, and
    the file (None without one); a ValueError naming the file when its patch, merge or temporal
    size differs from the family's model."""
    path = Path(folder) / "video_preprocessor_config.json"
    cfg = read_processor_config(path, family)
    if cfg is None:
        return None
    size = cfg.get("size") or {}
    lo = cfg.get("min_pixels", size.get("shortest_edge"))
    hi = cfg.get("max_pixels", size.get("longest_edge"))

    def num(key, kind):
        return None if cfg.get(key) is None else kind(cfg[key])

    return VideoSettings(fps=num("fps", float), min_frames=num("min_frames", int),
                         max_frames=num("max_frames", int),
                         min_pixels=None if lo is None else int(lo),
                         max_pixels=None if hi is None else int(hi),
                         cap_pixels_per_frame=num("cap_pixels_per_frame", bool),
                         max_video_tokens=num("max_video_tokens", int)), str(path)


@dataclass(frozen=True, slots=True)
class VideoMeta:
    """What is known of a video without decoding it."""

    total_frames: int
    fps: float
    width: int
    height: int


@dataclass(frozen=True, slots=True)
class VideoPlan:
    """How one video is encoded: its frames, size, grid and timing."""

    indices: tuple[int, ...]
    """Frames used, ascending (before the last is repeated to an even count)."""
    height: int
    width: int
    grid: tuple[int, int, int]
    """(t, h, w) in patches."""
    second_per_grid: float
    """Seconds one temporal patch spans (2 / sampled fps)."""
    timestamps: tuple[float, ...]
    """Mean time in seconds of each temporal patch's frames (qwen3 families' text)."""


@dataclass(frozen=True, slots=True)
class _Rules:
    """A family's video processor constants."""

    style: str  # "qwen2" | "qwen3"
    patch: int
    merge: int
    temporal: int
    min_pixels: int
    max_pixels: int
    max_video_tokens: int

    @property
    def factor(self) -> int:
        return self.patch * self.merge


def rules(family: str) -> _Rules:
    """The video processor constants of `family` (transformers' class defaults)."""
    f = family_of(family)
    if f.video_style == "qwen3":  # Qwen3VLVideoProcessor
        return _Rules("qwen3", f.patch_size, f.merge_size, f.temporal_patch_size,
                      128 * 32 * 32, 768 * 32 * 32, 768)
    return _Rules("qwen2", f.patch_size, f.merge_size, f.temporal_patch_size,  # Qwen2VL's
                  128 * 28 * 28, 768 * 28 * 28, 128000)


def sample_indices(family: str, meta: VideoMeta, settings: VideoSettings) -> tuple[int, ...]:
    """Frames of a video file that the family's processor samples."""
    import torch

    r, total, settings = rules(family), meta.total_frames, settings.over(DEFAULTS)
    if r.style == "qwen3":
        n = int(total / meta.fps * settings.fps)
        n = min(max(n, settings.min_frames), settings.max_frames, total)
        return tuple(np.linspace(0, total - 1, n).round().astype(int).tolist())
    most = math.floor(min(settings.max_frames, total) / r.temporal) * r.temporal
    n = min(max(total / meta.fps * settings.fps, settings.min_frames), most, total)
    n = math.floor(n / r.temporal) * r.temporal
    if n < 1:
        raise ValueError(f"{total} frame(s) is too short to sample")
    # torch's float arange, as the processor computes it (its rounding decides the frames)
    return tuple(torch.arange(0, total, total / n).int().tolist())


def frame_size(family: str, num_frames: int, height: int, width: int,
               settings: VideoSettings) -> tuple[int, int]:
    """(height, width) every frame is resized to; ValueError for a clip the processor refuses."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    r, settings = rules(family), settings.over(DEFAULTS)
    lo = r.min_pixels if settings.min_pixels is None else settings.min_pixels
    hi = r.max_pixels if settings.max_pixels is None else settings.max_pixels
    budget = r.max_video_tokens if settings.max_video_tokens is None else settings.max_video_tokens
    if r.style == "qwen2":
        if settings.cap_pixels_per_frame:
            total_pixels = int(budget * r.factor * r.factor * 0.9)
            hi = max(min(hi, total_pixels * r.temporal // num_frames), int(lo * 1.05))
        return smart_resize(height, width, factor=r.factor, min_pixels=lo, max_pixels=hi)
    if settings.cap_pixels_per_frame:
        per_frame = max(min(budget * r.factor * r.factor, hi // num_frames), int(lo * 1.05))
        hi = per_frame * num_frames
    return _smart_resize_clip(num_frames, height, width, r.temporal, r.factor, lo, hi)


def _smart_resize_clip(num_frames: int, height: int, width: int, temporal: int, factor: int,
                       min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen3-VL's resize rule: the clip's frames × height × width within the bounds."""
    if num_frames < temporal:
        raise ValueError(f"{num_frames} frame(s): the family needs at least {temporal}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} is over 200")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def plan(family: str, key: str, ref: VideoRef, settings: VideoSettings,
         max_image_pixels: int | None = None) -> VideoPlan:
    """How `ref` is encoded, from its metadata only; BadSampleError for an unusable video, and
    `TOO_LARGE` for frames above `max_image_pixels` (None: Pillow's decompression-bomb limit,
    as for images) or a frame list longer than `max_frames`."""
    most = settings.over(DEFAULTS).max_frames
    if len(ref.frames) > most:
        raise _bad(key, ref, TOO_LARGE, f"{len(ref.frames)} frames, more than max_frames={most}"
                   ": a frame list is used whole, so sample it down to at most that many "
                   "frames, or raise data.video.max_frames")
    image_limit(max_image_pixels)  # Pillow's own check on the frames agrees
    meta = read_meta(key, ref)
    limit = pixel_limit(max_image_pixels)
    if meta.width * meta.height > limit:
        raise _bad(key, ref, TOO_LARGE, f"its frames are {meta.width}x{meta.height} = "
                   f"{meta.width * meta.height:,} pixels, above the limit of {limit:,} (images' "
                   "decompression-bomb limit): downscale it, or if you trust the file raise the "
                   "limit: data.max_image_pixels=N (`vlpack pack` and `vlpack data validate`: "
                   "--max-image-pixels N)")
    try:
        indices = (tuple(range(meta.total_frames)) if ref.frames else
                   sample_indices(family, meta, settings))
        height, width = frame_size(family, len(indices), meta.height, meta.width, settings)
    except ValueError as e:
        raise BadSampleError("bad_video", f"{key}: video {ref.name} ({meta.width}x"
                             f"{meta.height}, {meta.total_frames} frames): {e}") from None
    r = rules(family)
    padded = list(indices) + [indices[-1]] * (-len(indices) % r.temporal)
    times = [i / meta.fps for i in padded]
    stamps = tuple((times[i] + times[i + r.temporal - 1]) / 2
                   for i in range(0, len(times), r.temporal))
    sampled_fps = len(indices) / meta.total_frames * meta.fps
    return VideoPlan(indices, height, width, (len(padded) // r.temporal, height // r.patch,
                                              width // r.patch),
                     r.temporal / sampled_fps, stamps)


# ------------------------------------------------------------------------- reading


def open_container(source: str | io.BytesIO):
    """`source` opened by PyAV as one of `VIDEO_CONTAINERS`, reading no other file or protocol
    (ImportError without PyAV; av.error.ArgumentError for another format)."""
    import av

    return av.open(source, container_options={"format_whitelist": VIDEO_CONTAINERS,
                                              "protocol_whitelist": "file"})


def read_meta(key: str, ref: VideoRef) -> VideoMeta:
    """Frame count, rate and size of `ref` without decoding pixels."""
    if ref.frames:
        for p in ref.frames:
            if not _is_file(p):
                raise _bad(key, ref, "missing_video",
                           f"frame {p} not found: fix the path (relative paths are resolved "
                           "against the JSONL file's folder) or drop the sample")
        from PIL import Image

        try:
            with open_raster(ref.frames[0]) as im:
                width, height = im.size
        except Image.DecompressionBombError as e:
            raise _bad(key, ref, TOO_LARGE, f"frame {ref.frames[0]} is larger than the pixel "
                       f"limit ({e}): downscale the frames, or if you trust them raise the limit: "
                       "data.max_image_pixels=N (--max-image-pixels N)") from None
        except Exception as e:
            raise _bad(key, ref, "corrupt_video", f"frame {ref.frames[0]} cannot be read "
                       f"({type(e).__name__}: {e})") from None
        return VideoMeta(len(ref.frames), ref.fps or FRAME_LIST_FPS, width, height)
    with _opened(key, ref) as container:
        try:
            stream = container.streams.video[0]
            total = stream.frames or sum(1 for p in container.demux(stream) if p.size)
            rate = float(stream.average_rate or stream.guessed_rate or 0)
            width, height = stream.codec_context.width, stream.codec_context.height
        except Exception as e:
            raise _bad(key, ref, "corrupt_video",
                       f"cannot be read ({type(e).__name__}: {e}): re-encode it (H.264 mp4) or "
                       "drop the sample") from None
    if total < 1 or rate <= 0 or width < 1 or height < 1:
        raise _bad(key, ref, "corrupt_video", f"holds no usable video stream ({total} frames, "
                   f"{rate} fps, {width}x{height}): re-encode it or drop the sample")
    return VideoMeta(total, ref.fps or rate, width, height)


def decode(key: str, ref: VideoRef, indices: tuple[int, ...],
           size: tuple[int, int] | None = None) -> np.ndarray:
    """The frames `indices` of `ref` as RGB uint8 [F, H, W, 3]; with `size` (height, width)
    each frame is resized to it as soon as it is decoded (as `patches` resizes), so one
    full-size frame is held at a time. All frames must have the first one's size."""
    frames: list[np.ndarray] = []
    first: tuple[int, int] | None = None

    def keep(frame: np.ndarray) -> None:  # its size is checked against the first's already
        nonlocal first
        first = first or frame.shape[:2]
        frames.append(frame if size is None else _resized(frame, size))

    if ref.frames:
        for i in indices:
            try:
                with open_raster(ref.frames[i]) as im:
                    if first is not None and im.size[::-1] != first:  # before decoding pixels
                        raise _bad(key, ref, "bad_video",
                                   "its frames differ in size: resize them to one size")
                    rgb = np.array(im.convert("RGB"))  # writable: torch takes it as is
            except BadSampleError:
                raise
            except Exception as e:
                raise _bad(key, ref, "corrupt_video", f"frame {ref.frames[i]} cannot be read "
                           f"({type(e).__name__}: {e})") from None
            keep(rgb)
    else:
        wanted, n = set(indices), 0
        with _opened(key, ref) as container:
            try:
                for i, frame in enumerate(container.decode(video=0)):
                    if i in wanted:
                        n += 1
                        if first is not None and (frame.height, frame.width) != first:
                            raise _bad(key, ref, "bad_video",
                                       "its frames differ in size: re-encode it at one size")
                        keep(frame.to_ndarray(format="rgb24"))
                    if i >= indices[-1]:
                        break
            except BadSampleError:
                raise
            except Exception as e:
                raise _bad(key, ref, "corrupt_video", f"cannot be decoded ({type(e).__name__}: "
                           f"{e}): re-encode it (H.264 mp4) or drop the sample") from None
        if n < len(indices):
            raise _bad(key, ref, "corrupt_video", f"decodes to fewer frames than its header "
                       f"says (needed frame {indices[-1]}): re-encode it or drop the sample")
    return np.stack(frames)


def patches(frames_FHW3: np.ndarray, vplan: VideoPlan, family: str,
            mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """Pixel patches [P, C] float32 of decoded frames (at any size, or already at the plan's),
    in the vision tower's order."""
    import torch

    r = rules(family)
    x = torch.from_numpy(np.ascontiguousarray(frames_FHW3)).permute(0, 3, 1, 2)  # uint8 F3HW
    if x.shape[2:] != (vplan.height, vplan.width):  # not yet resized by `decode`
        x = _resize(x, (vplan.height, vplan.width))
    x = x.float() / 255.0
    x = (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    if pad := -x.shape[0] % r.temporal:
        x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
    t, h, w = vplan.grid
    m, p = r.merge, r.patch
    x = x.view(t, r.temporal, 3, h // m, m, p, w // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(t * h * w, 3 * r.temporal * p * p).numpy()


def _resize(x_F3HW, size: tuple[int, int]):
    """uint8 frames [F, 3, H, W] resized bicubic with antialiasing (torchvision's CPU kernel);
    each frame's result does not depend on the others'."""
    import torch.nn.functional as F

    return F.interpolate(x_F3HW.contiguous(), size=size, mode="bicubic", align_corners=False,
                         antialias=True)


def _resized(frame_HW3: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """One RGB uint8 frame [H, W, 3] resized to `size` (height, width) as `patches` does."""
    import torch

    x = torch.from_numpy(np.ascontiguousarray(frame_HW3)).permute(2, 0, 1)[None]
    return _resize(x, size)[0].permute(1, 2, 0).numpy()


def _is_file(p: Path) -> bool:
    try:
        return p.is_file()
    except OSError:  # a name too long: `media_path` refuses it first for records
        return False


@contextmanager
def _opened(key: str, ref: VideoRef):
    """The container of `ref` (`open_container`), its opening errors as BadSampleError."""
    av = _pyav(key, ref)
    try:
        container = open_container(str(ref.path))
    except FileNotFoundError:
        raise _bad(key, ref, "missing_video", "file not found: fix the path (relative paths "
                   "are resolved against the JSONL file's folder) or drop the sample") from None
    except av.error.ArgumentError as e:  # EINVAL: FFmpeg's answer to a format off the list
        raise _bad(key, ref, UNSUPPORTED, f"is not in a container vlpack reads (MP4/MOV, "
                   f"Matroska/WebM, AVI, MPEG-TS, FLV; playlists such as .m3u8, concat lists and "
                   f"image patterns are refused, as they read other files) ({e}): re-encode it "
                   "(H.264 mp4) or drop the sample") from None
    except Exception as e:
        raise _bad(key, ref, "corrupt_video",
                   f"cannot be read ({type(e).__name__}: {e}): re-encode it (H.264 mp4) or "
                   "drop the sample") from None
    with container:
        yield container


def _pyav(key: str, ref: VideoRef):
    try:
        import av
    except ImportError:
        raise BadSampleError("video_decoder_missing", f"{key}: video {ref.name} needs PyAV to "
                             "decode: pip install 'vlpack[video]' (or give the video as a list "
                             "of frame images)") from None
    return av


def _bad(key: str, ref: VideoRef, reason: str, message: str) -> BadSampleError:
    return BadSampleError(reason, f"{key}: video {ref.name}: {message}")
