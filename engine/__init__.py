"""Qwen3.5 GRPO recipes for verl's fsdp_turbo backend: recipe -> plan -> launch -> export -> record."""

__version__ = "0.1.0"
