"""Inputs shared by the row-normalisation tests (rms_norm, add_rms_norm, layer_norm): layouts of
an input and value regimes, drawn in float64 from a seeded CPU generator."""

import torch


def layouts(rows_shape, hidden):
    """{name: (leaf shape, view of the leaf that the op receives)}. Gradients are taken with
    respect to the leaf, so a layout bug in the backward shows up too. Only "contiguous" for
    more than one row dim."""
    full = (*rows_shape, hidden)
    out = {"contiguous": (full, lambda t: t)}
    if len(rows_shape) == 1:
        rows = rows_shape[0]
        out.update({
            "transposed": ((hidden, rows), lambda t: t.t()),  # last-dim stride = rows
            "row_strided": ((rows, hidden + 5), lambda t: t[:, :hidden]),  # padded rows
            "offset": ((rows * hidden + 1,), lambda t: t[1:].view(full)),  # misaligned start
            "expanded": ((1, hidden), lambda t: t.expand(rows, hidden)),  # row stride 0
        })
    return out


def values(shape, regime, dtype, device, gen):
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    if regime == "large":
        x = x * 1e4 if dtype != torch.float16 else x * 5e3
    elif regime == "small":
        x = x * 1e-4  # comparable to eps: tests that eps is applied (layer_norm: var << eps)
    elif regime == "offset":
        x = x * 0.01 + 3.0  # large mean, small spread
    elif regime == "far_offset":
        x = x + 1e4  # mean^2 / var = 1e8: one-pass E[x^2] - E[x]^2 in float32 is pure rounding
    return x.to(device=device, dtype=dtype)
