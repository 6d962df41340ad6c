"""Activation-memory estimate of one rank, from the shapes of a decoder block (its family's ``activation_shapes``).

Why a formula and not a trace: the plan must answer in seconds for a 70B model on a
laptop, so nothing is run. The formula counts, tensor by tensor, what autograd keeps
for the backward of *this* model (engine.model) and the transient peak of the backward,
and is checked against measured peaks (tests/distributed/test_plan_measured.py, CPU;
a ``gpu`` test on CUDA).

Per micro-batch of ``N`` local tokens, with ``c`` the compute dtype's bytes, one block
without activation checkpointing keeps (``/t`` = split over tensor-parallel ranks):

- each RMSNorm: one fp32 ``N x D`` tensor (``4ND``: the upcast input for CUDA's fused
  kernel) and its rstd (``4N``); on CPU torch's composite ``rms_norm`` keeps the input and
  the normalised input (another ``4ND``); under sequence parallelism over ``N/t`` tokens only;
- the input of the following linears, ``cND`` (all-gathered to full ``N`` under SP);
- attention: rotated ``q`` and the SDPA output (``cN*q_dim/t`` each), ``k`` and ``v``
  (``cN*kv_dim/t`` each), the log-sum-exp (``4N*heads/t``);
- SwiGLU MLP: gate, ``silu(gate)``, up and their product (``4cNF/t``); GELU: 2 of them; an
  MoE block's routed experts are not split over TP (only its shared experts are), so its
  per-rank width ``F_local`` is given (``ffn_local``) rather than ``F/t``;
- in a single process under autocast, the compute-dtype copies of the block's weights.

Under context parallelism (``cp`` ranks per sequence) ``N`` is the local ``B*T/cp`` tokens,
except ``k`` and ``v``, which attention keeps gathered over the whole sequence (``N*cp``),
and a dense document mask, ``B x T/cp x T``. With torch's ring attention
(``cp_attention = ring``) ``k`` and ``v`` stay local, repeated to the query heads.

Full AC keeps only each block's input; selective/block does so on every k-th block;
selective/op keeps the block input plus the outputs of the matmuls and of SDPA. The
backward adds, transiently, one block's recomputed activations (when any block is
checkpointed), the gradient buffers of one block, and the logits and loss gradients
of the head (one chunk of them with a chunked loss).
"""

from __future__ import annotations

from dataclasses import dataclass

FP32 = 4


@dataclass(frozen=True)
class ActivationInputs:
    """Everything the estimate depends on (local sizes are derived from ``tp``)."""

    micro_batch: int
    seq_len: int
    dim: int
    q_dim: int
    kv_dim: int
    n_heads: int
    ffn: int
    gated: bool
    vocab: int
    norm: str  # "rmsnorm" | "layernorm"
    qk_norm: bool
    tp: int
    sequence_parallel: bool
    loss_parallel: bool
    compute_bytes: int
    autocast: bool  # single process with a compute dtype below fp32: torch.autocast casts per op
    cuda: bool  # CUDA kernels: a fused rms_norm (CPU's composite keeps the normalised input too), and an
    # SDPA op that op-level AC saves (CPU's _scaled_dot_product_flash_attention_for_cpu is recomputed)
    block_weight_copy_bytes: int  # compute-dtype weight copies autocast keeps per block (single process), else 0
    loss_chunk: int  # tokens per loss chunk (0 = the logits of the whole micro-batch at once)
    document_mask: bool  # attention runs with a dense SDPA mask (document masking, or a CP shard, without flex)
    ac_mode: str  # "none" | "full" | "selective_block" | "selective_op"
    ac_every_n_blocks: int = 2
    cp: int = 1  # context-parallel degree: each rank holds seq_len / cp tokens of every sequence
    ring: bool = False  # cp_attention = ring: K/V saved local (N tokens) at the query heads' width
    ffn_local: int = 0  # the MLP hidden width one TP rank computes (0 = ffn / tp; MoE: routed experts whole)

    @property
    def local_ffn(self) -> int:
        """MLP hidden units per TP rank: ``ffn_local`` when given, else the dense split ``ffn / tp``."""
        return self.ffn_local or self.ffn // self.tp

    @property
    def stream_bytes(self) -> int:
        """The residual stream's dtype: fp32 under autocast (the embedding is not cast), else the compute dtype."""
        return FP32 if self.autocast else self.compute_bytes

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch held by this rank (a 1/cp share of each sequence)."""
        return self.micro_batch * self.seq_len // self.cp

    @property
    def kv_tokens(self) -> int:
        """Key/value tokens attention keeps: the gathered full sequence under context parallelism."""
        return self.micro_batch * self.seq_len

    @property
    def stream_tokens(self) -> int:
        """Tokens of the residual stream held per rank: split over TP under sequence parallelism."""
        return self.tokens // self.tp if self.tp > 1 and self.sequence_parallel else self.tokens


def _norm_saved(a: ActivationInputs, width: int, tokens: int) -> int:
    """What one norm over ``tokens x width`` keeps for its backward (not its output).

    CUDA's fused ``rms_norm`` keeps the fp32 input and rstd; on CPU torch's composite also
    keeps the normalised input.
    """
    if a.norm == "layernorm":
        return a.compute_bytes * tokens * width + 2 * FP32 * tokens
    composite = 0 if a.cuda else FP32 * tokens * width
    return FP32 * tokens * width + composite + FP32 * tokens


def _attention_saved(a: ActivationInputs) -> int:
    n, c, t = a.tokens, a.compute_bytes, a.tp
    kv = n * 2 * a.q_dim if a.ring else a.kv_tokens * 2 * a.kv_dim
    saved = c * (n * 2 * a.q_dim + kv) // t + FP32 * n * a.n_heads // t
    if a.qk_norm:
        head_dim = a.q_dim // a.n_heads
        saved += _norm_saved(a, head_dim, n * (a.q_dim + a.kv_dim) // head_dim // t)
    if a.document_mask:  # the additive mask SDPA builds from the boolean one per call (queries x keys)
        saved += c * a.micro_batch * (a.seq_len // a.cp) * a.seq_len
    return saved


def _mlp_saved(a: ActivationInputs) -> int:
    return (4 if a.gated else 2) * a.compute_bytes * a.tokens * a.local_ffn


def block_full_bytes(a: ActivationInputs) -> int:
    """Bytes one block keeps for its backward without activation checkpointing."""
    norms = 2 * _norm_saved(a, a.dim, a.stream_tokens)
    # The inputs of the attention and MLP linears (all-gathered under SP). Autocast casts the fp32
    # norm output once per linear (query, key, value; gate, up), FSDP's mixed precision once per norm.
    casts = (3 + (2 if a.gated else 1)) if a.autocast else 2
    linear_inputs = casts * a.compute_bytes * a.tokens * a.dim
    return norms + linear_inputs + _attention_saved(a) + _mlp_saved(a) + a.block_weight_copy_bytes


def block_input_bytes(a: ActivationInputs) -> int:
    """What a checkpointed block keeps: its input (the residual stream)."""
    return a.stream_bytes * a.stream_tokens * a.dim


def block_op_bytes(a: ActivationInputs) -> int:
    """Selective op-level AC: the block input plus every matmul and SDPA output."""
    n, c, t = a.tokens, a.compute_bytes, a.tp
    column = (
        c * n * (a.q_dim + 2 * a.kv_dim) // t + c * n * (2 if a.gated else 1) * a.local_ffn
    )  # the column-parallel projections
    row = 2 * c * n * a.dim  # the row-parallel projections: full-size partial sums before TP's reduction
    sdpa = c * n * a.q_dim // t + FP32 * n * a.n_heads // t if a.cuda else 0
    return block_input_bytes(a) + column + row + sdpa


def block_saved_bytes(a: ActivationInputs, global_index: int) -> int:
    """Bytes block ``global_index`` keeps between its forward and its backward, under ``a.ac_mode``."""
    if a.ac_mode == "full":
        return block_input_bytes(a)
    if a.ac_mode == "selective_op":
        return block_op_bytes(a)
    if a.ac_mode == "selective_block" and global_index % a.ac_every_n_blocks == 0:
        return block_input_bytes(a)
    return block_full_bytes(a)


def block_backward_bytes(a: ActivationInputs) -> int:
    """Gradient buffers alive while one block runs its backward (activation grads, not weight grads).

    The widest moment is the MLP's: the gradient of an ``N x F/t`` intermediate is built
    while the saved one it replaces is freed, next to the gradient of the block's output.
    """
    n, c = a.tokens, a.compute_bytes
    return c * n * a.local_ffn + max(a.stream_bytes * a.stream_tokens, c * n) * a.dim


def head_saved_bytes(a: ActivationInputs) -> int:
    """Final norm + what the head keeps: its input, and the fp32 logits the loss keeps (unchunked)."""
    saved = _norm_saved(a, a.dim, a.stream_tokens) + a.compute_bytes * a.tokens * a.dim
    if a.loss_chunk == 0:
        saved += FP32 * a.tokens * _local_vocab(a)
    return saved


def loss_transient_bytes(a: ActivationInputs) -> int:
    """Peak extra memory of the loss backward: fp32 logit gradients and their temporaries.

    Unchunked, the backward of log-sum-exp and of the target gather each build an fp32
    ``tokens x vocab`` tensor plus one temporary, on top of the saved fp32 logits. A
    chunked loss recomputes one chunk's logits in the backward, and each chunk adds a
    gradient of the head weight before it is accumulated.
    """
    vocab = _local_vocab(a)
    if a.loss_chunk == 0:
        tokens, recompute, head_grad = a.tokens, 0, 0
    else:
        tokens, recompute = min(a.loss_chunk, a.tokens), 1
        head_grad = a.compute_bytes * vocab * a.dim + a.compute_bytes * a.tokens * a.dim
    cast = a.compute_bytes * tokens * vocab if a.compute_bytes < FP32 else 0
    return (4 + recompute) * FP32 * tokens * vocab + cast + head_grad


def _local_vocab(a: ActivationInputs) -> int:
    return a.vocab // a.tp if a.tp > 1 and a.loss_parallel else a.vocab


@dataclass(frozen=True)
class ActivationEstimate:
    """The peak activation bytes of one rank, and the parts it is made of."""

    saved_per_microbatch: int  # kept between the forward and the backward of one micro-batch
    microbatches_in_flight: float  # micro-batches whose activations are alive at once (pipeline warm-up)
    transient: int  # the largest backward working set: the loss with the head's tensors, or one block's
    peak: int

    def as_dict(self) -> dict[str, float]:
        return {
            "saved_per_microbatch": self.saved_per_microbatch,
            "microbatches_in_flight": self.microbatches_in_flight,
            "transient": self.transient,
            "peak": self.peak,
        }


def estimate_activations(
    a: ActivationInputs, block_ids: list[int], has_head: bool, microbatches_in_flight: float = 1.0
) -> ActivationEstimate:
    """Peak activation bytes of a rank holding blocks ``block_ids`` (global indices), and the head if ``has_head``.

    The peak is the larger of two backward phases, on top of the activations of the
    other micro-batches in flight: the loss (every block's saved tensors, the head's and
    the loss gradients), or the backward of one block, walking blocks last to first (the
    blocks after it have freed theirs; a checkpointed block recomputes its activations).
    """
    ids = sorted(block_ids)
    by_class: dict[bool, int] = {}  # a block's saved bytes depend on its index only under selective block AC
    saved = []
    for i in ids:
        cls = a.ac_mode == "selective_block" and i % a.ac_every_n_blocks == 0
        if cls not in by_class:
            by_class[cls] = block_saved_bytes(a, i)
        saved.append(by_class[cls])
    blocks = sum(saved)
    head = head_saved_bytes(a) if has_head else 0
    phases = [blocks + head + loss_transient_bytes(a)] if has_head else []
    working = block_full_bytes(a) + block_backward_bytes(a)  # one block's backward: recomputed + gradients
    alive = 0
    for kept in saved:
        alive += kept
        phases.append(alive + working - kept)
    others = int((microbatches_in_flight - 1) * (blocks + head))
    peak = others + max(phases, default=0)
    return ActivationEstimate(blocks + head, microbatches_in_flight, peak - others - blocks - head, peak)


def pipeline_in_flight(schedule: str, pp: int, pp_rank: int, stages_per_rank: int, microbatches: int) -> float:
    """Micro-batches (in units of this rank's whole set of stages) whose activations one rank holds at once.

    1F1B: rank ``r`` runs ``pp - r`` forwards before its first backward; GPipe runs all of
    them. Interleaved schedules run ``(v - 1) * pp + 2 * (pp - 1 - r) + 1`` stage-forwards
    (``v`` stages per rank) before the first backward, each holding one stage's
    activations, i.e. ``1/v`` of this rank's; V-shaped and zero-bubble schedules are
    counted the same way (an approximation: their split backward frees weight-gradient
    inputs later).
    """
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(microbatches)
    if stages_per_rank == 1:
        return float(min(pp - pp_rank, microbatches))
    v = stages_per_rank
    warmup = (v - 1) * pp + 2 * (pp - 1 - pp_rank) + 1
    return min(warmup, microbatches * v) / v


def bubble_fraction(pp: int, stages_per_rank: int, microbatches: int) -> float:
    """Idle fraction of a pipeline step: ``(pp - 1) / (v * m + pp - 1)`` (1F1B family)."""
    if pp == 1:
        return 0.0
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)
