"""The name recipes give verl in `VERL_USE_EXTERNAL_MODULES` for the fast kernels: importing it in a verl
process applies `engine.runtime.kernels` (with `ENGINE_FLA_CONV1D=1`, fla before any model is built)."""

from engine.runtime.kernels import fla_conv1d_fn, install_token_logprobs, select_kernels, token_logprobs

__all__ = ["fla_conv1d_fn", "install_token_logprobs", "select_kernels", "token_logprobs"]
