"""Reading images and video clips into float arrays in ``[0, 1]``, with errors that name the file.

Images go through Pillow (any format it reads), converted to RGB (3 channels) or L (1)
and resized to ``image_size x image_size`` when their size differs. A clip is a
directory of frame images (sorted by file name) or a ``.npy`` array ``[F, H, W(, C)]``
(uint8 0-255 or float 0-1, loaded without pickle). ``video.frame_stride`` keeps every
n-th frame; a clip still longer than ``video.max_frames`` is sampled uniformly over its
whole length (a caption describes the whole clip); a shorter one is padded and masked
later, by the batch builder.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from kforge_cli.errors import InvalidInputError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


class BadSampleError(InvalidInputError):
    """A sample (image, clip or caption) cannot be used: the message names the file and the fix."""


def _mode(channels: int) -> str:
    if channels == 3:
        return "RGB"
    if channels == 1:
        return "L"
    raise InvalidInputError(f"vision_encoder.channels = {channels}: image data supports 1 (grey) or 3 (RGB)")


def load_image(path: Path, image_size: int, channels: int) -> np.ndarray:
    """``[channels, image_size, image_size]`` float32 in [0, 1]; BadSampleError naming ``path`` otherwise."""
    from PIL import Image, UnidentifiedImageError

    mode = _mode(channels)
    try:
        with Image.open(path) as img:
            img.load()
            img = img.convert(mode)
            if img.size != (image_size, image_size):
                img = img.resize((image_size, image_size), Image.Resampling.BILINEAR)
            arr = np.asarray(img, dtype=np.float32) / 255.0
    except FileNotFoundError:
        raise BadSampleError(f"image {path} does not exist") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise BadSampleError(f"image {path} is corrupt or not an image ({exc})") from None
    return arr[None] if channels == 1 else np.ascontiguousarray(arr.transpose(2, 0, 1))


MAX_IMAGE_BYTES = 64 * 2**20  # an image file given on the command line (kforge generate --image)
MAX_IMAGE_PIXELS = 8192 * 8192
IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF")


def read_image_file(path: Path, image_size: int, channels: int) -> np.ndarray:
    """One image a user names (``kforge generate --image``), read as untrusted input.

    A regular file of at most 64 MiB, one of the common raster formats (never the ones
    Pillow hands to external programs), at most 8192 x 8192 pixels as its header says
    before anything is decoded; then converted and resized as training data is. Every
    failure is an InvalidInputError naming the file.
    """
    import io
    import os
    import stat
    import warnings

    from PIL import Image, UnidentifiedImageError

    mode = _mode(channels)
    try:
        info = os.stat(path)
    except OSError as exc:
        raise InvalidInputError(f"--image {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(info.st_mode):
        raise InvalidInputError(f"--image {path} is not a regular file")
    if info.st_size > MAX_IMAGE_BYTES:
        raise InvalidInputError(f"--image {path} is {info.st_size:,} bytes, over the {MAX_IMAGE_BYTES:,}-byte limit")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_IMAGE_BYTES + 1)
    except OSError as exc:
        raise InvalidInputError(f"--image {path} is unreadable ({exc.strerror or exc})") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidInputError(f"--image {path} is over the {MAX_IMAGE_BYTES:,}-byte limit")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as img:
                width, height = img.size
                if width * height > MAX_IMAGE_PIXELS or min(width, height) < 1:
                    raise InvalidInputError(
                        f"--image {path} is {width} x {height} pixels; at most {MAX_IMAGE_PIXELS:,} pixels are read"
                    )
                img.load()
                img = img.convert(mode)
                if img.size != (image_size, image_size):
                    img = img.resize((image_size, image_size), Image.Resampling.BILINEAR)
                arr = np.asarray(img, dtype=np.float32) / 255.0
    except InvalidInputError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise InvalidInputError(
            f"--image {path} is too large: at most {MAX_IMAGE_PIXELS:,} pixels are read ({exc})"
        ) from None
    except UnidentifiedImageError as exc:
        raise InvalidInputError(
            f"--image {path} is not an image kforge reads ({', '.join(IMAGE_FORMATS)}; {exc})"
        ) from None
    except (OSError, ValueError, SyntaxError, EOFError, MemoryError) as exc:
        raise InvalidInputError(f"--image {path} is corrupt ({exc})") from None
    return arr[None] if channels == 1 else np.ascontiguousarray(arr.transpose(2, 0, 1))


def _resize_frames(frames: np.ndarray, image_size: int) -> np.ndarray:
    """``[F, C, H, W]`` -> ``[F, C, image_size, image_size]`` (bilinear, antialiased) when sizes differ."""
    if frames.shape[-2:] == (image_size, image_size):
        return frames
    t = torch.from_numpy(frames)
    out = F.interpolate(t, size=(image_size, image_size), mode="bilinear", align_corners=False, antialias=True)
    return out.clamp(0.0, 1.0).numpy()


def _load_npy_clip(path: Path, image_size: int, channels: int) -> np.ndarray:
    try:
        arr = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise BadSampleError(f"clip {path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise BadSampleError(f"clip {path} is not a readable .npy array ({exc})") from None
    if arr.ndim == 3:
        arr = arr[..., None]
    if arr.ndim != 4 or arr.shape[0] < 1 or arr.shape[-1] not in (1, 3):
        raise BadSampleError(f"clip {path} has shape {arr.shape}; expected [frames, H, W] or [frames, H, W, 1|3]")
    if arr.dtype == np.uint8:
        frames = arr.astype(np.float32) / 255.0
    elif np.issubdtype(arr.dtype, np.floating):
        frames = np.clip(arr.astype(np.float32), 0.0, 1.0)
    else:
        raise BadSampleError(f"clip {path} has dtype {arr.dtype}; expected uint8 (0-255) or float (0-1)")
    if frames.shape[-1] != channels:  # grey <-> RGB
        frames = frames.mean(-1, keepdims=True) if channels == 1 else np.repeat(frames, channels, axis=-1)
    return _resize_frames(np.ascontiguousarray(frames.transpose(0, 3, 1, 2)), image_size)


def frame_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())


def select_frames(count: int, max_frames: int, stride: int) -> np.ndarray:
    """Indices of the frames kept: every ``stride``-th, then at most ``max_frames`` spread over the clip."""
    idx = np.arange(0, count, stride)
    if len(idx) > max_frames:
        idx = idx[np.linspace(0, len(idx) - 1, max_frames).round().astype(np.int64)]
    return idx


def load_clip(path: Path, image_size: int, channels: int, max_frames: int, stride: int) -> np.ndarray:
    """``[n, channels, image_size, image_size]`` with ``1 <= n <= max_frames`` (see the module docstring)."""
    if path.is_dir():
        files = frame_files(path)
        if not files:
            raise BadSampleError(f"clip directory {path} holds no frame images ({', '.join(IMAGE_SUFFIXES)})")
        keep = select_frames(len(files), max_frames, stride)
        return np.stack([load_image(files[i], image_size, channels) for i in keep.tolist()])
    if path.suffix.lower() == ".npy":
        frames = _load_npy_clip(path, image_size, channels)
        return np.ascontiguousarray(frames[select_frames(len(frames), max_frames, stride)])
    if not path.exists():
        raise BadSampleError(f"clip {path} does not exist")
    raise BadSampleError(f"clip {path} is neither a directory of frames nor a .npy array")
