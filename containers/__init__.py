"""Image tooling of the repository: hashed locks, resolution of pins, builds (run as `python -m containers.X`)."""
