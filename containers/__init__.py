"""Image tooling of the repository: hashed locks, pins, builds (run as `python -m containers.X`)."""
