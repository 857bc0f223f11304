"""kernelgate: every op call routed to the fastest kernel proven correct for it.

    import kernelgate as kg
    y = kg.rms_norm(x, weight, eps=1e-6)
    print(kg.explain("rms_norm", x, weight))

The decision is made in C++ (libkernelgate); this package loads it and adds a thin face.
"""

import torch  # noqa: F401  (loads LibTorch before our library)

from . import _C  # noqa: F401  (registers torch.ops.kernelgate)
from ._api import Explanation, Warmup, explain, ops, use, warmup
from ._define import define_op, register_backend
from ._logging import install_log_hook
from . import _ops
from ._ops import geglu, rms_norm, swiglu
from ._ops import add_rms_norm, layer_norm
from ._ops import qk_norm_rope, rope
from ._ops import cross_entropy, linear_cross_entropy
from ._ops import attention
from .gated_delta_rule import gated_delta_rule  # defined from Python, before its library backends
from .kda import kda
from .attention_varlen import attention_varlen  # kg.attention's varlen form
from . import _inductor, backends, evidence, policy

__version__ = "0.1.0"
__all__ = ["rms_norm", "swiglu", "geglu", "explain", "ops", "use", "policy", "evidence", "Explanation", "__version__"]
__all__ += ["define_op", "register_backend", "warmup", "Warmup"]
__all__ += ["add_rms_norm", "layer_norm"]
__all__ += ["rope", "qk_norm_rope"]
__all__ += ["cross_entropy", "linear_cross_entropy", "gated_delta_rule", "kda", "attention"]

install_log_hook()
backends.install()  # the field's libraries (not imported until used)
evidence.install()
_inductor.install()  # kernelgate's ops as Inductor fallbacks, once Inductor is imported


def __getattr__(name: str):
    """kg.<op> for every op, those defined later (kg.define_op, plugins) included."""
    if not name.startswith("_") and name in {o["name"] for o in _C.ops()}:
        fn = _ops.routed(name)
        globals()[name] = fn  # found once
        return fn
    raise AttributeError(f"module 'kernelgate' has no attribute '{name}'")
