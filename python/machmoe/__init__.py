"""machmoe: fast, memory-lean Mixture-of-Experts layers for NVIDIA Hopper GPUs, from PyTorch."""
from ._library import load_library as _load_library

_load_library()

from . import _ops  # noqa: E402,F401  (fake implementations and autograd of the operators)
from ._ops import defer_weight_grads  # noqa: E402
from .functional import (check_device_errors, fallback_policy, grouped_experts,  # noqa: E402
                         index_checking_enabled, load_balancing_loss, moe, moe_from_routing, router_z_loss,
                         set_fallback_policy, set_index_checking, set_sm_margin, sm_margin, sm_margin_scope)
from .module import MoE, MoEOutput  # noqa: E402
from . import parallel  # noqa: E402,F401  (machmoe.parallel: expert parallelism, docs/PARALLEL.md)

__all__ = ["MoE", "MoEOutput", "defer_weight_grads", "moe", "moe_from_routing", "grouped_experts",
           "load_balancing_loss", "router_z_loss", "set_index_checking", "index_checking_enabled",
           "check_device_errors", "set_fallback_policy", "fallback_policy", "set_sm_margin", "sm_margin",
           "sm_margin_scope"]
__version__ = "0.1.0"
