"""verl's FSDP checkpoints: their on-disk layout, the per-expert MoE key rule, the mesh-agnostic merge,
the export to Hugging Face safetensors and its verification."""
