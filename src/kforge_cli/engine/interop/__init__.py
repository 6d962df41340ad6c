"""engine.interop (above engine.checkpoint): kforge checkpoints to and from other formats.

Hugging Face export (`hf_export`, the per-architecture layouts in `hf_layout`, `hf_moe` and
`hf_vlm`) and import (`hf_import`, the weight-name and config mapping in `hf_format` and
`hf_moe`, tokenizers in `hf_tokenizer`), the dense-to-MoT
conversion (`mot_convert`), and `load_model`, which reads any checkpoint kforge can
(a run, a step directory or a Hugging Face directory) into a model for inference.
"""
