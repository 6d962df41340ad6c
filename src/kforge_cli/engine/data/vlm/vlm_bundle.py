"""`build_vlm_data`: image/clip-caption batches with the text loader's stateful contract.

The sample order is the text data's :class:`SampleOrder` over one "dataset" of
samples (deterministic, partitioned over data-parallel ranks, resumable from a few
counters, re-partitionable to another dp size), driven by the same
:class:`StatefulLoader`; only the fetcher differs. Every rank's batch has the same
shapes:

    input_ids     [B, L]             L = vlm.max_text_len; EOS + caption + EOS, padded with EOS
    labels        [B, L]             next tokens; padding is IGNORE_INDEX (-100)
    pixel_values  [B, F, C, H, W]    float32 in [0, 1]; F = video.max_frames (1 without [video])
    frame_mask    [B, F]             True for real frames; padded frames are zeros and False
    dataset_ids   [B]                zeros (one dataset)

A caption that does not fit ``max_text_len`` is never truncated: it is an error naming
the sample, or (``vlm.skip_bad_samples``) the sample is dropped and counted. An image
that fails to decode while training is an error naming the file, or is replaced by the
next readable sample (deterministically, so a resume sees the same batch) and counted.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from kforge_cli.engine.data.loader import StatefulLoader, training_loader
from kforge_cli.engine.data.mixture import MixtureSchedule
from kforge_cli.engine.data.tokenizer import Tokenizer, load_tokenizer
from kforge_cli.engine.data.tokens import IGNORE_INDEX
from kforge_cli.engine.data.vlm.media import BadSampleError
from kforge_cli.engine.data.vlm.pair_sources import ManifestCaptions, Record, drop_missing, resolve_records
from kforge_cli.engine.data.vlm.synthetic import SyntheticCaptions
from kforge_cli.errors import InvalidInputError
from kforge_cli.settings import JobSettings
from kforge_cli.settings.vlm import VideoSettings, VisionEncoderSettings, VLMSettings

log = logging.getLogger("kforge")

SYNTHETIC_TRAIN, SYNTHETIC_VAL = 4096, 256
_VAL_SEED_OFFSET = 1_000_003


class CaptionSource(Protocol):
    def __len__(self) -> int: ...

    def where(self, index: int) -> str: ...

    def caption(self, index: int) -> str: ...

    def load(self, index: int) -> tuple[np.ndarray, str]: ...


class CaptionBatcher:
    """Turns sample indices into a fixed-shape batch (the loader's fetcher; also used for val)."""

    def __init__(self, source: CaptionSource, tok: Tokenizer, *, text_len: int, frames: int, skip_bad: bool) -> None:
        self.source, self.tok, self.text_len, self.frames, self.skip_bad = source, tok, text_len, frames, skip_bad
        self.skipped = 0  # samples replaced because their media could not be read (this process)

    def encode(self, caption: str, where: str) -> np.ndarray:
        """``[EOS] + caption + [EOS]``; BadSampleError when it does not fit ``text_len`` inputs."""
        ids = [self.tok.eos_id, *self.tok.encode(caption), self.tok.eos_id]
        if len(ids) - 1 > self.text_len:
            raise BadSampleError(
                f"the caption of {where} has {len(ids) - 2} tokens but vlm.max_text_len = {self.text_len} holds at "
                f"most {self.text_len - 1}: raise vlm.max_text_len (and train.seq_len), shorten the caption, or set "
                "--vlm.skip_bad_samples=true to skip such samples (text is never truncated)"
            )
        return np.asarray(ids, dtype=np.int64)

    def _load(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        n = len(self.source)
        for attempt in range(n):
            i = (index + attempt) % n
            try:
                frames, caption = self.source.load(i)
                return frames, self.encode(caption, self.source.where(i))
            except BadSampleError as exc:
                if not self.skip_bad:
                    raise
                self.skipped += 1
                log.warning("skipping a bad sample (%d so far): %s", self.skipped, exc)
        raise InvalidInputError("no sample of the data set can be read")

    def __call__(self, dataset_ids: np.ndarray, indices: np.ndarray) -> dict[str, torch.Tensor]:
        first, *_ = self._load(int(indices[0]))
        bsz, (_, c, h, w) = len(indices), first.shape
        pixels = np.zeros((bsz, self.frames, c, h, w), dtype=np.float32)
        frame_mask = np.zeros((bsz, self.frames), dtype=bool)
        inputs = np.full((bsz, self.text_len), self.tok.eos_id, dtype=np.int64)
        labels = np.full((bsz, self.text_len), IGNORE_INDEX, dtype=np.int64)
        for row, index in enumerate(indices.tolist()):
            frames, ids = self._load(int(index))
            n = min(len(frames), self.frames)
            pixels[row, :n], frame_mask[row, :n] = frames[:n], True
            inputs[row, : len(ids) - 1] = ids[:-1]
            labels[row, : len(ids) - 1] = ids[1:]
        return {
            "input_ids": torch.from_numpy(inputs),
            "labels": torch.from_numpy(labels),
            "pixel_values": torch.from_numpy(pixels),
            "frame_mask": torch.from_numpy(frame_mask),
            "dataset_ids": torch.from_numpy(np.asarray(dataset_ids, dtype=np.int64)),
        }


class VLMValData:
    """Deterministic eval batches: rank ``r``'s ``k``-th batch starts at sample ``(k * dp_size + r) * batch_size``."""

    def __init__(self, batcher: CaptionBatcher, dp_rank: int, dp_size: int) -> None:
        self.batcher, self.dp_rank, self.dp_size = batcher, dp_rank, dp_size

    def iter_batches(self, num_batches: int, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
        n = len(self.batcher.source)
        for k in range(num_batches):
            start = (k * self.dp_size + self.dp_rank) * batch_size
            idx = (start + np.arange(batch_size)) % n
            yield self.batcher(np.zeros(batch_size, dtype=np.int64), idx)


@dataclass
class VLMDataBundle:
    """What the training loop gets for a VLM job (the same fields as engine.data.DataBundle)."""

    train: StatefulLoader
    val: VLMValData | None
    vocab_size: int
    dataset_names: list[str]
    tokenizer: Tokenizer
    batcher: CaptionBatcher

    @property
    def skipped_samples(self) -> int:
        return self.batcher.skipped


def _fitting(records: list[Record], batcher: CaptionBatcher, skip: bool) -> list[Record]:
    """Records whose caption fits (checked up front, so a long caption fails before step 1)."""
    kept = []
    for r in records:
        try:
            batcher.encode(r.caption, f"{r.path} (from {r.where})")
            kept.append(r)
        except BadSampleError:
            if not skip:
                raise
    if len(kept) < len(records):
        log.warning(
            "skipped %d of %d samples whose caption exceeds vlm.max_text_len", len(records) - len(kept), len(records)
        )
    if not kept:
        raise InvalidInputError("no usable samples: every caption exceeds vlm.max_text_len")
    return kept


def _sources(
    vlm: VLMSettings, enc: VisionEncoderSettings, video: VideoSettings | None, tok: Tokenizer, *, seed: int
) -> tuple[str, CaptionSource, CaptionSource | None]:
    """The caption sources (synthetic, or the manifests of ``vlm.data_path``); ``seed`` orders the synthetic set."""
    frames = video.max_frames if video is not None else 1
    stride = video.frame_stride if video is not None else 1
    if vlm.data_path is None:
        train = SyntheticCaptions(
            SYNTHETIC_TRAIN, enc.image_size, enc.channels, seed=seed, max_frames=frames, video=video is not None
        )
        val = SyntheticCaptions(
            SYNTHETIC_VAL,
            enc.image_size,
            enc.channels,
            seed=seed + _VAL_SEED_OFFSET,
            max_frames=frames,
            video=video is not None,
        )
        probe = CaptionBatcher(train, tok, text_len=vlm.max_text_len, frames=frames, skip_bad=False)
        probe.encode("a purple square at the bottom right.", "the synthetic set")  # its longest caption
        return "synthetic", train, val
    name, train_records, val_records = resolve_records(vlm.data_path)
    out: list[CaptionSource | None] = []
    for records in (train_records, val_records):
        if records is None:
            out.append(None)
            continue
        records = drop_missing(records, vlm.skip_bad_samples)
        probe = CaptionBatcher(
            ManifestCaptions(records, enc.image_size, enc.channels, frames, stride),
            tok,
            text_len=vlm.max_text_len,
            frames=frames,
            skip_bad=False,
        )
        records = _fitting(records, probe, vlm.skip_bad_samples)
        out.append(ManifestCaptions(records, enc.image_size, enc.channels, frames, stride))
    assert out[0] is not None
    return name, out[0], out[1]


def build_vlm_data(settings: JobSettings, *, dp_rank: int, dp_size: int) -> VLMDataBundle:
    """The train loader and val data of data-parallel rank ``dp_rank`` of ``dp_size`` for a VLM job."""
    vlm = settings.vlm
    if vlm is None or settings.vision_encoder is None:
        raise InvalidInputError("build_vlm_data needs the [vlm] and [vision_encoder] sections")
    tok = load_tokenizer(settings.data.tokenizer)
    if tok.vocab_size > settings.model.vocab_size:
        raise InvalidInputError(
            f"the tokenizer ({tok.name}) has {tok.vocab_size} ids but model.vocab_size is {settings.model.vocab_size}: "
            f"set --model.vocab_size={tok.vocab_size} or more"
        )
    frames = settings.video.max_frames if settings.video is not None else 1
    name, train_src, val_src = _sources(vlm, settings.vision_encoder, settings.video, tok, seed=settings.data_seed)
    batcher = CaptionBatcher(train_src, tok, text_len=vlm.max_text_len, frames=frames, skip_bad=vlm.skip_bad_samples)
    schedule = MixtureSchedule.build([name], [1.0], settings.data.temperature, [])
    loader = training_loader(
        settings.train,
        settings.data,
        [name],
        [len(train_src)],
        schedule,
        batcher,
        seed=settings.data_seed,
        seq_len=vlm.max_text_len,
        dp_rank=dp_rank,
        dp_size=dp_size,
    )
    val = None
    if val_src is not None:
        val_batcher = CaptionBatcher(
            val_src, tok, text_len=vlm.max_text_len, frames=frames, skip_bad=vlm.skip_bad_samples
        )
        val = VLMValData(val_batcher, dp_rank, dp_size)
    return VLMDataBundle(
        train=loader, val=val, vocab_size=tok.vocab_size, dataset_names=[name], tokenizer=tok, batcher=batcher
    )
