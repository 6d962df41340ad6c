"""engine.data.vlm: image/clip-caption data for vision-language jobs (layer 1).

``build_vlm_data(settings, dp_rank=0, dp_size=1)`` returns a bundle whose ``train`` loader
yields dicts of ``input_ids``, ``labels``, ``pixel_values`` ``[B, F, C, H, W]``,
``frame_mask`` ``[B, F]`` and ``dataset_ids``, with the text loader's state contract.
"""

from kforge_cli.engine.data.vlm.media import BadSampleError, load_clip, load_image
from kforge_cli.engine.data.vlm.pair_sources import (
    ManifestCaptions,
    Record,
    read_manifest,
    resolve_records,
    scan_directory,
)
from kforge_cli.engine.data.vlm.synthetic import SyntheticCaptions
from kforge_cli.engine.data.vlm.vlm_bundle import CaptionBatcher, VLMDataBundle, VLMValData, build_vlm_data

__all__ = [
    "BadSampleError",
    "CaptionBatcher",
    "ManifestCaptions",
    "Record",
    "SyntheticCaptions",
    "VLMDataBundle",
    "VLMValData",
    "build_vlm_data",
    "load_clip",
    "load_image",
    "read_manifest",
    "resolve_records",
    "scan_directory",
]
