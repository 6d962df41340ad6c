"""Sections that shape the model and the optimisation: model, train, optimizer, scheduler."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from kforge_cli.settings.gemma3 import Gemma3Settings
from kforge_cli.settings.mla import MLASettings
from kforge_cli.settings.moe import MoESettings, ffn_params
from kforge_cli.settings.section import Section, field

MAX_SEED = 2**63 - 1  # torch.manual_seed's range; seed + step must stay inside it
Beta = Annotated[float, Field(ge=0, lt=1)]


class ModelSettings(Section):
    """The model: its family (``engine/families``) and the shape fields that family reads."""

    family: str = field(
        "llama",
        "Model family (engine/families): llama (Llama/Qwen3, dense or MoE), deepseek_v3 (MLA, MTP), gemma3, gpt2, or one a package registers.",
        min_length=1,
    )
    dim: int = field(256, "Hidden size of the residual stream.", gt=0)
    n_layers: int = field(4, "Number of Transformer blocks.", gt=0)
    n_heads: int = field(8, "Number of attention (query) heads.", gt=0)
    n_kv_heads: int | None = field(
        None, "Key/value heads for grouped-query attention (None = n_heads, i.e. MHA).", gt=0
    )
    vocab_size: int = field(512, "Vocabulary size of the embedding and output head.", gt=0)
    max_seq_len: int = field(2048, "Longest sequence the model supports (RoPE table length).", gt=0)
    ffn_hidden_dim: int | None = field(
        None, "Hidden size of the MLP (None = 8/3*dim for SwiGLU, 4*dim for GELU, rounded up).", gt=0
    )
    ffn_dim_multiplier: float = field(1.0, "Multiplier on the automatic MLP hidden size.", gt=0)
    multiple_of: int = field(64, "Round the automatic MLP hidden size up to a multiple of this.", gt=0)
    rope_theta: float = field(10000.0, "RoPE base frequency (theta).", gt=0)
    norm: Literal["rmsnorm", "layernorm"] = field("rmsnorm", "Normalisation layer type.")
    norm_eps: float = field(1e-5, "Epsilon of the normalisation layers.", gt=0)
    activation: Literal["swiglu", "gelu"] = field("swiglu", "MLP type: SwiGLU (gated) or GELU.")
    qk_norm: bool = field(False, "Normalise queries and keys per head before RoPE.")
    tie_embeddings: bool = field(False, "Share the token embedding with the output head.")
    init_std: float = field(0.02, "Std of the normal initialisation of weights.", gt=0)
    moe: MoESettings | None = field(None, "Mixture-of-Experts feed-forward layers (None = a dense model).")
    mla: MLASettings | None = field(None, "Multi-head latent attention (model.family = deepseek_v3 only).")
    mtp_depth: int = field(
        0, "Multi-token prediction modules: each predicts one token further ahead (0 = off).", ge=0, le=8
    )
    mtp_loss_weight: float = field(0.3, "Weight of the mean multi-token-prediction loss in the total loss.", ge=0)
    gemma3: Gemma3Settings | None = field(None, "Gemma 3's local/global attention layout (model.family = gemma3 only).")
    attention: Literal["sdpa", "flex", "auto"] = field(
        "auto",
        "Attention kernel: sdpa, flex (FlexAttention block mask; CUDA for training), "
        "auto (flex on CUDA with data.document_masking, else sdpa).",
    )

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        if self.gemma3 is not None and self.gemma3.head_dim is not None:
            return self.gemma3.head_dim
        return self.dim // self.n_heads

    @property
    def rope_dim(self) -> int:
        """Dimensions RoPE rotates per head (the whole head; MLA's rotary part)."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    @property
    def resolved_ffn_hidden_dim(self) -> int:
        """The MLP hidden size actually built (explicit, or derived from dim)."""
        if self.ffn_hidden_dim is not None:
            return self.ffn_hidden_dim
        hidden = int(2 * 4 * self.dim / 3) if self.activation == "swiglu" else 4 * self.dim
        hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def block_params(self, layer: int = 0, *, active: bool = False) -> int:
        """Parameters of block ``layer``: attention (wq, wk, wv, wo, QK-norm), MLP or MoE, two norms.

        ``active``: only those one token passes through (an MoE block's top_k routed experts).
        """
        d, hd = self.dim, self.head_dim
        if self.mla is not None:
            attention = self.mla.attention_params(d, self.n_heads)
        else:
            attention = 2 * d * self.n_heads * hd + 2 * d * self.kv_heads * hd
            if self.qk_norm:
                attention += 2 * hd
        return attention + ffn_params(self, layer, active=active) + 2 * d

    def mtp_params(self, *, active: bool = False) -> int:
        """Parameters of the multi-token-prediction modules (each: two input norms, the ``2 dim -> dim``
        projection, a block like block ``n_layers + k``, an output norm; embedding and head shared)."""
        d = self.dim
        return sum(
            3 * d + 2 * d * d + self.block_params(self.n_layers + k, active=active) for k in range(self.mtp_depth)
        )

    def _blocks_params(self, active: bool) -> int:
        return sum(self.block_params(i, active=active) for i in range(self.n_layers))

    def non_embedding_params(self) -> int:
        """``N`` of the FLOP formula: all *active* parameters but the token embedding (the head counts
        once, tied or not); an MoE block counts its router, shared and top_k routed experts."""
        mtp = self.mtp_params(active=True) + self.mtp_depth * self.vocab_size * self.dim
        return self._blocks_params(True) + self.dim + self.vocab_size * self.dim + mtp

    def param_count(self, *, active: bool = False) -> int:
        """Parameters of the built text Transformer (a tied head counted once); ``active``: per token."""
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return (
            self.vocab_size * self.dim + self._blocks_params(active) + self.dim + head + self.mtp_params(active=active)
        )


class TrainSettings(Section):
    """The training loop: batch shape, steps, precision, memory/speed trade-offs."""

    run_dir: str | None = field(
        None, "Run directory (None = runs/<profile>[-<data>]-<timestamp>); an existing one auto-resumes."
    )
    batch_size: int = field(8, "Micro-batch size in sequences per data-parallel rank.", gt=0)
    seq_len: int = field(256, "Tokens per training sequence.", gt=0)
    max_steps: int = field(1000, "Number of optimizer steps to train for.", gt=0)
    grad_accum_steps: int = field(1, "Micro-batches per optimizer step (also the pipeline micro-batch count).", gt=0)
    grad_clip_norm: float = field(1.0, "Clip the global gradient norm to this (0 = no clipping).", ge=0)
    seed: int = field(42, "Seed for model initialisation and every RNG.", ge=0, le=MAX_SEED)
    data_seed: int | None = field(None, "Seed of the data order (None = train.seed).", ge=0, le=MAX_SEED)
    device: Literal["auto", "cpu", "cuda"] = field("auto", "Device to train on (auto = cuda if available).")
    mixed_precision: Literal["auto", "fp32", "bf16", "fp16"] = field(
        "auto", "Compute dtype (auto = bf16 on CUDA, fp32 on CPU); parameters stay in master_dtype."
    )
    master_dtype: Literal["fp32", "bf16"] = field(
        "fp32", "Dtype of parameters and optimizer state (the master weights)."
    )
    activation_checkpointing: Literal["none", "full", "selective"] = field(
        "none", "Activation checkpointing: none, full (every block) or selective."
    )
    ac_selective_mode: Literal["block", "op"] = field(
        "block", "Selective AC: every k-th block, or op-level (save matmul outputs only)."
    )
    ac_every_n_blocks: int = field(2, "Selective block AC checkpoints every k-th block.", gt=0)
    compile_model: bool = field(False, "torch.compile each Transformer block.")
    float8: bool = field(False, "Train linear layers in float8 (torchao).")
    float8_recipe: Literal["tensorwise", "rowwise"] = field("tensorwise", "torchao float8 scaling recipe.")
    loss_chunk_size: int = field(
        0, "Compute cross-entropy in chunks of this many tokens, never materialising all logits (0 = off).", ge=0
    )
    z_loss_weight: float = field(0.0, "Weight of the z-loss (log(Z)^2) regulariser (0 = off).", ge=0)
    hooks: list[str] = field(list, "Training hooks by import path, e.g. 'my_pkg.hooks:LogGradNorms'.")
    early_stop_patience: int = field(
        0, "Stop after this many in-loop evaluations without an eval-loss improvement (0 = off).", ge=0
    )
    early_stop_min_delta: float = field(
        0.0, "Early stopping: an eval loss counts as better only when lower by more than this.", ge=0
    )
    num_threads: int | None = field(
        None,
        "torch CPU threads per process (None = OMP_NUM_THREADS when set, else automatic: the cores this process "
        "may use (affinity, cgroup quota) minus those other work keeps busy, divided by the local processes).",
        gt=0,
    )

    def tokens_per_step(self, dp_size: int) -> int:
        """Global tokens one optimizer step consumes (every micro-batch of every data-parallel rank)."""
        return self.batch_size * self.seq_len * self.grad_accum_steps * dp_size


class OptimizerSettings(Section):
    """The optimizer. Parameters and state are kept in train.master_dtype."""

    name: Literal["adamw", "lion", "muon"] = field("adamw", "Optimizer: adamw, lion or muon.")
    lr: float = field(3e-4, "Peak learning rate.", gt=0)
    weight_decay: float = field(0.1, "Decoupled weight decay.", ge=0)
    betas: tuple[Beta, Beta] = field((0.9, 0.95), "Adam/Lion betas (beta1, beta2), each in [0, 1).")
    eps: float = field(1e-8, "Adam epsilon.", gt=0)
    fused: bool | None = field(None, "Use the fused AdamW kernel (None = when available).")
    decay_norms_and_biases: bool = field(False, "Apply weight decay to norm weights and biases too.")
    decay_embeddings: bool = field(False, "Apply weight decay to embeddings too.")
    muon_lr: float = field(0.02, "Learning rate of Muon's 2-D weights (the rest use optimizer.lr).", gt=0)
    muon_momentum: float = field(0.95, "Muon momentum.", ge=0, lt=1)
    muon_nesterov: bool = field(True, "Nesterov momentum in Muon.")
    muon_ns_steps: int = field(5, "Newton-Schulz iterations in Muon.", gt=0)
    muon_distributed: bool = field(
        True,
        "Split Muon's Newton-Schulz over the ranks holding each sharded matrix (each rank orthogonalises "
        "~1/N of them; the same update); false: every rank gathers and orthogonalises every matrix.",
    )


class SchedulerSettings(Section):
    """Learning-rate schedule (a multiplier on optimizer.lr)."""

    name: Literal["cosine", "linear", "wsd", "constant", "rex"] = field(
        "cosine", "Schedule after warmup: cosine, linear, wsd (warmup-stable-decay), constant, rex."
    )
    warmup_steps: int = field(100, "Linear warmup steps from 0 to the peak LR.", ge=0)
    decay_steps: int | None = field(
        None, "Steps of decay (None = all steps after warmup; for wsd: the cooldown length).", ge=0
    )
    min_lr_ratio: float = field(0.1, "Final LR as a fraction of the peak.", ge=0, le=1)
    wsd_cooldown: Literal["cosine", "linear", "sqrt"] = field("linear", "Shape of the WSD cooldown.")
