"""Helpers shared by several test folders: synthetic run directories, the bad-input world, offline
RO-Crate validation. Synthetic sharded checkpoints come from benchmarks.synthetic_checkpoints."""
