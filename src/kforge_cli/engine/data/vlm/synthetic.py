"""The built-in synthetic image-caption (and clip-caption) set: trains a VLM with no download.

Sample ``i`` is drawn from its own generator seeded by ``(seed, i)``, so any sample can
be produced by any rank at any time (no files, nothing cached) and a resumed run sees
exactly the same data. An image shows one coloured shape on a dark, slightly noisy
background; its caption names the colour, the shape and where it is, so a model can
only get the caption right by looking at the image:

    "a red cross at the top left."

A clip (video jobs) shows the shape moving; its caption names the direction
("a blue ring moving right.") and its length varies between half of ``max_frames`` and
``max_frames`` frames, so padding and frame masks are exercised.
"""

from __future__ import annotations

import numpy as np

COLORS: dict[str, tuple[float, float, float]] = {
    "red": (0.9, 0.1, 0.1),
    "green": (0.1, 0.8, 0.2),
    "blue": (0.15, 0.25, 0.95),
    "yellow": (0.95, 0.9, 0.1),
    "white": (0.95, 0.95, 0.95),
    "purple": (0.6, 0.1, 0.8),
}
SHAPES = ("square", "ring", "cross")
PLACES: dict[str, tuple[float, float]] = {  # (row, column) of the centre, as fractions of the side
    "top left": (0.25, 0.25),
    "top right": (0.25, 0.75),
    "bottom left": (0.75, 0.25),
    "bottom right": (0.75, 0.75),
    "centre": (0.5, 0.5),
}
MOTIONS: dict[str, tuple[float, float]] = {
    "left": (0.0, -1.0),
    "right": (0.0, 1.0),
    "up": (-1.0, 0.0),
    "down": (1.0, 0.0),
}


def _shape_mask(kind: str, size: int, side: int, row: float, col: float) -> np.ndarray:
    """Boolean ``[size, size]`` mask of a shape of ``side`` pixels centred at (row, col) pixels."""
    ys, xs = np.mgrid[0:size, 0:size]
    dy, dx = np.abs(ys + 0.5 - row), np.abs(xs + 0.5 - col)
    half = side / 2
    inside = (dy <= half) & (dx <= half)
    if kind == "square":
        return inside
    if kind == "ring":
        return inside & ~((dy <= half - max(1.0, side / 4)) & (dx <= half - max(1.0, side / 4)))
    arm = max(1.0, side / 6)
    return inside & ((dy <= arm) | (dx <= arm))


class SyntheticCaptions:
    """``len`` samples; :meth:`load` gives ``(frames [n, C, H, W] float32 in [0, 1], caption)``."""

    def __init__(
        self, num_samples: int, image_size: int, channels: int, *, seed: int, max_frames: int = 1, video: bool = False
    ) -> None:
        self.num_samples, self.image_size, self.channels = num_samples, image_size, channels
        self.seed, self.max_frames, self.video = seed, max_frames, video

    def __len__(self) -> int:
        return self.num_samples

    def where(self, index: int) -> str:
        return f"synthetic sample {index}"

    def caption(self, index: int) -> str:
        return self.load(index)[1]

    def load(self, index: int) -> tuple[np.ndarray, str]:
        rng = np.random.default_rng([self.seed, index])
        color = list(COLORS)[int(rng.integers(len(COLORS)))]
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        size = self.image_size
        side = max(3, size // 3)
        if self.video:
            motion = list(MOTIONS)[int(rng.integers(len(MOTIONS)))]
            frames = int(rng.integers(max(1, self.max_frames // 2), self.max_frames + 1))
            dy, dx = MOTIONS[motion]
            span = size / 2
            centres = [
                (
                    size / 2 + dy * span * (t / max(1, frames - 1) - 0.5),
                    size / 2 + dx * span * (t / max(1, frames - 1) - 0.5),
                )
                for t in range(frames)
            ]
            caption = f"a {color} {shape} moving {motion}."
        else:
            place = list(PLACES)[int(rng.integers(len(PLACES)))]
            fy, fx = PLACES[place]
            centres = [(fy * size, fx * size)]
            caption = f"a {color} {shape} at the {place}."
        rgb = np.asarray(COLORS[color], dtype=np.float32)
        paint = rgb[:, None, None] if self.channels == 3 else np.full((self.channels, 1, 1), rgb.mean(), np.float32)
        out = np.empty((len(centres), self.channels, size, size), dtype=np.float32)
        for t, (row, col) in enumerate(centres):
            noise = rng.random((self.channels, size, size), dtype=np.float32) * 0.1
            mask = _shape_mask(shape, size, side, row, col)
            out[t] = np.where(mask[None], paint, noise)
        return out, caption
