"""One FLOP counter for the benchmarks: torch's `FlopCounterMode` with the attention kernels it cannot count.

torch's SDPA formulas assert that keys and values have the query's number of heads (grouped-query attention, as
SmolLM2 runs it on CUDA, fails them), and torch has no formula at all for the CPU flash-attention kernel. Both get
torch's own formulas here, with keys and values counted at the query's head count (every query head reads its
group's keys and values): attention is counted dense, as torch counts it.
"""

from __future__ import annotations

import torch

_KERNELS = ("flash_attention", "efficient_attention", "cudnn_attention", "flash_attention_for_cpu")


def _heads_matched(query, key, value) -> tuple:
    heads = query[-3]
    return tuple(key[:-3]) + (heads,) + tuple(key[-2:]), tuple(value[:-3]) + (heads,) + tuple(value[-2:])


def _sdpa(query, key, value, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query, *_heads_matched(query, key, value))


def _sdpa_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count

    return sdpa_backward_flop_count(grad_out, query, *_heads_matched(query, key, value))


def flop_counter():
    """A `FlopCounterMode` (no display) that also counts every SDPA kernel this torch has, GQA included."""
    from torch.utils.flop_counter import FlopCounterMode

    mapping = {}
    for name in _KERNELS:
        for op, fn in ((f"_scaled_dot_product_{name}", _sdpa), (f"_scaled_dot_product_{name}_backward", _sdpa_backward)):
            if hasattr(torch.ops.aten, op):
                mapping[getattr(torch.ops.aten, op)] = fn
    return FlopCounterMode(display=False, custom_mapping=mapping)
