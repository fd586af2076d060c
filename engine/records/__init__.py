"""What a run leaves behind for others: the provenance record (and its Snakemake chain), the RO-Crate
views of it, the model card, and re-running a run from its record."""
