"""The rules of context parallelism (``distributed.cp``, ``distributed.cp_attention``), in one place.

Every CP rank holds a head and a tail chunk of each sequence, so sequences split into
``2 * cp`` equal chunks; under sequence parallelism each CP rank's ``seq_len / cp`` tokens
split again over the TP ranks. Attention over the whole sequence either all-gathers K/V
(``allgather``: exact with any mask, gloo or NCCL) or runs torch's ring attention for SDPA
(``ring``: CUDA only, plain causal attention only, since torch's ring kernels take no mask).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kforge_cli.errors import ConfigIssue

if TYPE_CHECKING:
    from kforge_cli.settings.job import JobSettings

RING_CPU = (
    "ring attention runs torch's context-parallel SDPA kernels (flash / memory-efficient / cuDNN), which need "
    "CUDA; on CPU use --distributed.cp_attention=allgather"
)


def context_parallel_issues(s: JobSettings) -> list[ConfigIssue]:
    """What context parallelism needs: sequences in 2*cp equal chunks; the combinations it supports."""
    d, t = s.distributed, s.train
    if d.cp == 1:
        return []
    out: list[ConfigIssue] = []
    if t.seq_len % (2 * d.cp):
        out.append(
            ConfigIssue(
                "train.seq_len",
                f"{t.seq_len} is not divisible by 2 * distributed.cp = {2 * d.cp} (each CP rank holds a head "
                "and a tail chunk of every sequence)",
            )
        )
    elif d.tp > 1 and d.sequence_parallel and (t.seq_len // d.cp) % d.tp:
        out.append(
            ConfigIssue(
                "train.seq_len",
                f"{t.seq_len} / distributed.cp = {t.seq_len // d.cp} tokens per CP rank are not divisible by "
                f"distributed.tp ({d.tp}) (sequence parallelism splits each CP rank's tokens over the TP ranks)",
            )
        )
    if s.vlm is not None:  # image tokens are spliced into the sequence inside the model, after sharding
        out.append(ConfigIssue("distributed.cp", "context parallelism is not supported for VLM models"))
    if d.cp_attention == "ring":
        out += _ring_issues(s)
    return out


def _ring_issues(s: JobSettings) -> list[ConfigIssue]:
    out: list[ConfigIssue] = []
    if s.data.document_masking:
        out.append(
            ConfigIssue(
                "distributed.cp_attention",
                "ring attention supports plain causal attention only (torch's ring SDPA takes no mask); with "
                "data.document_masking use cp_attention = 'allgather' (FlexAttention on CUDA)",
            )
        )
    if s.model.attention == "flex":
        out.append(
            ConfigIssue(
                "distributed.cp_attention",
                "ring attention runs SDPA; set model.attention = 'sdpa' or 'auto', or cp_attention = 'allgather'",
            )
        )
    if s.train.device == "cpu":
        out.append(ConfigIssue("distributed.cp_attention", RING_CPU))
    return out
