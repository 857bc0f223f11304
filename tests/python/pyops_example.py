"""A research op defined from Python and Python backends, as a user would write them: the contract
suite (test_contracts.py) checks them like the built-in ops and backends, and
test_contracts.py::test_python_backend_end_to_end sweeps them with `--load` this file.

  softcap(x, bias=None, cap=30.0) = cap * tanh((x + bias) / cap)   (logit soft-capping, Gemma 2)
  py_softcap: a Python backend of softcap with its own forward and backward
  py_rms_norm: a Python backend of the built-in rms_norm (its forward returns the extra rstd)

Importing this module registers them once per process (a second import is a no-op)."""

import torch

import kernelgate as kg


def softcap_reference(x, bias, cap):
    acc = torch.promote_types(x.dtype, torch.float32)  # float64 inputs: the oracle
    h = x.to(acc) if bias is None else x.to(acc) + bias.to(acc)
    return (cap * torch.tanh(h / cap)).to(x.dtype)


softcap = kg.define_op(
    "softcap(Tensor x, Tensor? bias=None, float cap=30.0) -> Tensor",
    dims="x: [*rows, hidden]; bias?: [hidden]",
    reference=softcap_reference,
    test_values={"cap": [30.0, 1.0, 50.0]},
    dim_ranges={"rows": (0, 65536), "hidden": (1, 65536)},
    production_shapes=[{"rows": 4096, "hidden": 4096}, {"rows": 8192, "hidden": 2048}],
)


CALLS = {"py_softcap": 0}  # forward calls: the end-to-end test sees the dispatcher serve it


def py_softcap_forward(x, bias, cap):
    CALLS["py_softcap"] += 1
    h = x.float() if bias is None else x.float() + bias.float()
    return (torch.tanh(h * (1.0 / cap)) * cap).to(x.dtype)


def py_softcap_backward(dy, x, bias, cap):
    h = x.float() if bias is None else x.float() + bias.float()
    t = torch.tanh(h * (1.0 / cap))
    dh = dy.float() * (1.0 - t * t)
    dbias = None if bias is None else dh.reshape(-1, x.shape[-1]).sum(0).to(bias.dtype)
    return dh.to(x.dtype), dbias


def py_rms_norm_forward(x, weight, eps):
    xf = x.float()
    rstd = torch.rsqrt(xf.square().mean(-1) + eps)
    y = xf * rstd.unsqueeze(-1)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype), rstd  # rstd: the op's extra, float32 of shape x.shape[:-1]


def py_rms_norm_backward(dy, x, weight, rstd, eps):
    xhat = x.float() * rstd.unsqueeze(-1)
    dyf = dy.float()
    g = dyf if weight is None else dyf * weight.float()
    dx = rstd.unsqueeze(-1) * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = None if weight is None else (dyf * xhat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    return dx.to(x.dtype), dw


kg.register_backend("softcap", "py_softcap", py_softcap_forward, py_softcap_backward)
kg.register_backend("rms_norm", "py_rms_norm", py_rms_norm_forward, py_rms_norm_backward)
