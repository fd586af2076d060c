"""The software environment: container pins against installed versions, and the offline wheelhouse."""
