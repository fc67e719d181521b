"""Capture on the original model: the residual stream `z` and `dl/dz` at every candidate position, and the
candidate blocks whose vector-Jacobian product at `z` is the gradient of a zero-initialised block (docs/theory.md §2).

At `theta = 0` the grown model equals the original, so the gradient of the loss with respect to a new
block's parameters is the VJP of the block output at `z` with the original model's activation gradient
`g = dl/dz`; only the zeroed output projections get a non-zero gradient. One forward and one backward
of the original model therefore serve every position.

Example:
    ```python
    >>> from hf_depthgrow.probe.capture import ResidualTap
    >>> tap = ResidualTap(stack, {0, 2}, set(), before_adapters=True)
    >>> _ = model(**inputs); sorted(tap.z)
    [0, 2]
    >>> tap.remove()
    ```
"""

from __future__ import annotations

import inspect
import math

import torch
from torch import nn

from ..growth import adapter
from ..growth.config import GrowthConfig
from ..growth.engine import build_block
from ..growth.checks import check_positions
from ..growth.families import FamilySpec, model_eps, residual_output_targets
from ..growth.towers import resolve_family
from ..growth.norms import is_norm, norm_eps

__all__ = ["CandidateBlock", "ResidualTap", "checked_positions", "forward_kwargs", "next_norm_eps"]


def checked_positions(model: nn.Module, positions) -> tuple[nn.ModuleList, list[int]]:
    """The layer stack and the positions in the caller's order (`None`: all of 0..L), each checked."""
    _, stack, _ = resolve_family(model)
    if positions is None:
        return stack, list(range(len(stack) + 1))
    check_positions(positions, len(stack))
    return stack, list(positions)


def forward_kwargs(model: nn.Module) -> dict:
    """The keyword arguments of a forward that generates nothing: no KV cache (it only costs memory)."""
    return {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}


_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


class ResidualTap:
    """Hooks on the original layers: capture `z` at the wanted positions and every layer's call arguments.

    Where a captured `z` is not yet part of an autograd graph (the parameters are frozen during the
    probe), it is replaced by an identical leaf that requires grad, so that one backward gives
    `dl/dz` at every position and nothing upstream of the first wanted position is differentiated.
    """

    def __init__(self, stack: nn.ModuleList, z_positions: set[int], call_layers: set[int], *, before_adapters: bool):
        self.num_layers = len(stack)
        self.z: dict[int, torch.Tensor] = {}
        self.calls: dict[int, tuple[tuple, dict]] = {}
        self.handles = []
        for i, layer in enumerate(stack):
            if i in z_positions or i in call_layers:
                hook = self._pre(i, i in z_positions, i in call_layers)
                # A native block goes into the layer list before layer k, so ahead of adapter blocks
                # already hung on layer k's input; a new adapter block is appended after them.
                self.handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True, prepend=before_adapters))
        if self.num_layers in z_positions:
            self.handles.append(stack[-1].register_forward_hook(self._post))

    def _pre(self, index: int, want_z: bool, want_call: bool):
        def hook(module, args, kwargs):
            by_kwarg = not args
            hidden = kwargs["hidden_states"] if by_kwarg else args[0]
            rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            if want_call:
                self.calls[index] = (tuple(args[1:]), rest)
            if not want_z:
                return None
            if hidden.requires_grad:
                self.z[index] = hidden
                return None
            hidden = hidden.detach().requires_grad_(True)
            self.z[index] = hidden
            if by_kwarg:
                return args, {**kwargs, "hidden_states": hidden}
            return (hidden, *args[1:]), kwargs

        return hook

    def _post(self, module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.requires_grad:
            self.z[self.num_layers] = hidden
            return None
        hidden = hidden.detach().requires_grad_(True)
        self.z[self.num_layers] = hidden
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    def clear(self) -> None:
        self.z, self.calls = {}, {}

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _scrub_cache(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Call arguments of an original layer, made safe for a candidate layer: no KV cache."""
    try:
        from transformers.cache_utils import Cache
    except ImportError:  # pragma: no cover
        Cache = ()
    args = tuple(None if isinstance(a, Cache) else a for a in args)
    kwargs = dict(kwargs)
    for key in _CACHE_KWARGS:
        if key in kwargs:
            kwargs[key] = None
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    return args, kwargs


# --------------------------------------------------------------------------- candidate blocks


def _detach_input(module, args, kwargs):
    # Cut the graph at the zeroed projection's input: a path through it carries `grad @ W = 0`
    # at zero init, so dropping it is exact and spares backpropagating through the block's MLP.
    if args:
        return (args[0].detach(), *args[1:]), kwargs
    for key in ("input", "hidden_states", "x"):
        if isinstance(kwargs.get(key), torch.Tensor):
            return args, {**kwargs, key: kwargs[key].detach()}
    return None


class _ZeroLinear(torch.autograd.Function):
    """`F.linear(x, weight, bias)` where weight and bias are all zero: zeros out, the weight's gradient back,
    without the forward matmul (a third of a block's matmul work, and its output is known to be 0).

    No gradient goes to `x`: it is `grad @ weight = 0` (the input is detached anyway, `_detach_input`)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x)
        ctx.has_bias, ctx.dtype = bias is not None, weight.dtype
        return x.new_zeros(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])
        grad_w = rows.t().mm(x.reshape(-1, x.shape[-1]).to(rows.dtype)).to(ctx.dtype)
        return None, grad_w, rows.sum(0).to(ctx.dtype) if ctx.has_bias else None


def _skip_zero_matmul(module: nn.Module) -> None:
    """Where a zeroed output projection is a plain `nn.Linear`, its forward returns zeros without the matmul."""
    if type(module) is not nn.Linear or any(bool(p.detach().any()) for p in module.parameters(recurse=False)):
        return  # another layer type (an expert bank, a quantized linear) or not zero: the module's own forward
    module.forward = lambda x: _ZeroLinear.apply(x, module.weight, module.bias)


class CandidateBlock:
    """The block `grow_depth(model, [k], ...)` would insert, prepared for the VJP at `z`."""

    def __init__(self, model: nn.Module, stack: nn.ModuleList, spec: FamilySpec, position: int, cfg: GrowthConfig):
        self.position = position
        self.kind, self.module = build_block(model, position, cfg)
        self.module.eval()
        if self.kind == "native":
            # Exactly the zeroed parameters: for a fused MoE expert bank its down projection, not the
            # bank's gate_up_proj (whose gradient is 0 at zero init but would count in the statistics).
            targets = residual_output_targets(spec, self.module)
            outputs = [module for _, module, _ in targets]
            ids = {id(p) for _, _, params in targets for p in params}
        else:
            outputs = [self.module.w_out]
            ids = {id(p) for p in self.module.w_out.parameters(recurse=False)}
        # The native block copies layer k-1 and takes its per-layer config entries (attention
        # type, sliding window), so it is called with the arguments layer k-1 receives.
        self.source = max(position - 1, 0) if self.kind == "native" else None
        self.names = [n for n, p in self.module.named_parameters() if id(p) in ids]
        self.params = [self.module.get_parameter(n) for n in self.names]
        for p in self.module.parameters():
            p.requires_grad_(id(p) in ids)
        self.shapes = [p.shape for p in self.params]
        self.numel = sum(p.numel() for p in self.params)
        self.handles = [m.register_forward_pre_hook(_detach_input, with_kwargs=True) for m in outputs]
        for m in outputs:  # the block is the probe's own copy: its modules can be changed
            _skip_zero_matmul(m)

    def gradient(self, z: torch.Tensor, g: torch.Tensor, call: tuple[tuple, dict] | None) -> list[torch.Tensor]:
        """Gradient of `<g, block(z)>` per output parameter: the VJP with upstream `g`."""
        z = z.detach()
        with torch.enable_grad():
            if self.kind == "native":
                args, kwargs = _scrub_cache(*call)
                out = self.module(z, *args, **kwargs)
            else:
                out = self.module(z)
            out = out[0] if isinstance(out, tuple) else out
            grads = torch.autograd.grad(out, self.params, grad_outputs=g, allow_unused=True)
        return [torch.zeros_like(p) if gr is None else gr for gr, p in zip(grads, self.params)]

    def unflatten(self, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        out, start = {}, 0
        for name, shape in zip(self.names, self.shapes):
            n = math.prod(shape)
            out[name] = vector[start : start + n].view(shape).clone()
            start += n
        return out

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def next_norm_eps(model: nn.Module, spec: FamilySpec, stack: nn.ModuleList, position: int) -> float:
    """eps of the norm that next sees the residual stream at `position` (see `ProbeResult`)."""
    fallback = model_eps(spec, model.config) or 1e-6
    if position < len(stack):
        for name, module in stack[position].named_modules():
            if name.startswith((adapter.PRE, adapter.POST)):
                continue
            if is_norm(module) and norm_eps(module) is not None:
                return norm_eps(module)
        return fallback
    # k = L: the first norm registered after the layer stack in the base model (the final norm).
    base = getattr(model, "base_model", model)
    after, stack_seen = None, False
    stack_ids = {id(m) for m in stack.modules()}
    for _, module in base.named_modules():
        if module is stack:
            stack_seen = True
            continue
        if stack_seen and id(module) not in stack_ids and is_norm(module) and norm_eps(module) is not None:
            after = norm_eps(module)
            break
    return after if after is not None else fallback
