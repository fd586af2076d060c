"""Recipes: the typed schema, the YAML loader with profiles, `extends:` and `--set`, the model registry,
the compiled plan (verl's Hydra overrides) and the generated reference. Imports no torch."""
