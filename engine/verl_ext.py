"""The module verl imports by name through `VERL_USE_EXTERNAL_MODULES` (recipes' cpu profile, the images):
importing it installs `engine.runtime` (platform, rollout, kernels, checks) in that verl process."""

from engine.runtime import install

install()
