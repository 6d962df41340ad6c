"""The DeepSeek-V3 family: multi-head latent attention, kforge's MoE, multi-token prediction."""

from kforge_cli.engine.families.deepseek_v3.model import DeepseekV3Transformer, MLAttention, MTPModule, mtp_labels

__all__ = ["DeepseekV3Transformer", "MLAttention", "MTPModule", "mtp_labels"]
