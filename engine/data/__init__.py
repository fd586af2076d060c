"""Data: verl RL parquet from geo3k/gsm8k/synthetic sources, and the tiny offline model, tokenizer and
data built from the model registry."""
