"""The generic normalized residual block and how it is attached to a host layer.

An adapter block `z -> z + W_out act(W_in N_eps(z))` with `W_out = 0` is the identity at init
for every family, post-norm ones included (docs/theory.md §1 (b)). It does not take a slot in the
layer list: it hangs on an original layer through a forward (pre-)hook, so the layer count,
the per-layer config lists (sliding/full attention) and the KV-cache slots stay exactly as
they were. Position k < L attaches to the input of layer k ("pre"); k == L to the output of
the last layer ("post").
"""

from __future__ import annotations

import math

import torch
from torch import nn

ACTIVATIONS = {"gelu": nn.GELU, "silu": nn.SiLU, "relu": nn.ReLU, "tanh": nn.Tanh}
PRE, POST = "depthgrow_pre", "depthgrow_post"


class NormalizedResidualBlock(nn.Module):
    """`z + W_out act(W_in N_eps(z))`, zero-initialised in `W_out` so it starts as the identity.

    Args:
        hidden_size: Width of the residual stream.
        dim: Width of the block's hidden layer.
        norm: `"rms"` (RMSNorm) or `"layer"` (LayerNorm), matching the family.
        eps: Epsilon of the block's own norm; must be > 0.
        act: One of `gelu`, `silu`, `relu`, `tanh`.
        generator: Seeds `W_in` so that the same call always builds the same block.

    Example:
        ```python
        >>> block = NormalizedResidualBlock(64, 64, norm="rms", eps=1e-6)
        >>> z = torch.randn(2, 5, 64)
        >>> torch.equal(block(z), z)
        True
        ```
    """

    def __init__(
        self,
        hidden_size: int,
        dim: int,
        *,
        norm: str = "rms",
        eps: float = 1e-6,
        act: str = "gelu",
        generator: torch.Generator | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if norm not in ("rms", "layer"):
            raise ValueError(f"norm must be 'rms' or 'layer', got {norm!r}")
        if act not in ACTIVATIONS:
            raise ValueError(f"act must be one of {sorted(ACTIVATIONS)}, got {act!r}")
        self.norm = nn.RMSNorm(hidden_size, eps=eps) if norm == "rms" else nn.LayerNorm(hidden_size, eps=eps)
        self.w_in = nn.Linear(hidden_size, dim)
        self.act = ACTIVATIONS[act]()
        self.w_out = nn.Linear(dim, hidden_size)
        with torch.no_grad():
            # N_eps(z) has unit RMS, so std 1/sqrt(d) gives unit-scale pre-activations.
            self.w_in.weight.normal_(0.0, 1.0 / math.sqrt(hidden_size), generator=generator)
            self.w_in.bias.zero_()
            # W_out = 0 makes the block the identity; W_in stays non-zero so that the
            # gradient with respect to W_out (the first-order signal) does not vanish.
            self.w_out.weight.zero_()
            self.w_out.bias.zero_()
        self.to(dtype=dtype, device=device)
        self.enabled = True  # cleared by `bypass_new_blocks`

    def branch(self, z: torch.Tensor) -> torch.Tensor:
        """`W_out act(W_in N_eps(z))`: what the block adds to the residual stream."""
        return self.w_out(self.act(self.w_in(self.norm(z))))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z + self.branch(z) if self.enabled else z


def _apply(blocks: nn.ModuleList, hidden: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        hidden = block(hidden)
    return hidden


def _pre_hook(module, args, kwargs):
    blocks = getattr(module, PRE, None)
    if not blocks:
        return None
    if args:
        return (_apply(blocks, args[0]), *args[1:]), kwargs
    kwargs = dict(kwargs)
    kwargs["hidden_states"] = _apply(blocks, kwargs["hidden_states"])
    return args, kwargs


def _post_hook(module, args, output):
    blocks = getattr(module, POST, None)
    if not blocks:
        return None
    if isinstance(output, (tuple, list)):  # some families (OpenAI GPT) return a list
        return type(output)([_apply(blocks, output[0]), *output[1:]])
    return _apply(blocks, output)


def _has_hooks(host: nn.Module) -> bool:
    return any(fn is _pre_hook for fn in host._forward_pre_hooks.values())


def ensure_hooks(host: nn.Module) -> None:
    """Register the pre/post hooks on `host` once; they do nothing while it hosts no blocks."""
    # Hooks are found by identity rather than through stored handles: a deep copy of a host
    # layer copies its hook dicts, and a copied handle would still point at the original's.
    if _has_hooks(host):
        return
    host.register_forward_pre_hook(_pre_hook, with_kwargs=True)
    host.register_forward_hook(_post_hook)


def attach(host: nn.Module, block: NormalizedResidualBlock, where: str) -> None:
    """Attach `block` before (`where="pre"`) or after (`"post"`) the host layer."""
    name = PRE if where == "pre" else POST
    if not hasattr(host, name):
        host.add_module(name, nn.ModuleList())
    getattr(host, name).append(block)
    ensure_hooks(host)


def detach(host: nn.Module, block: NormalizedResidualBlock) -> bool:
    """Take `block` off `host` (the inverse of `attach`); `True` where it was there.

    The hooks stay: with no blocks hosted they return the input unchanged.

    Example:
        ```python
        >>> attach(layer, block, "pre")
        >>> detach(layer, block), hosted_blocks(layer)["pre"]
        (True, [])
        ```
    """
    found = False
    for name in (PRE, POST):
        hosted = getattr(host, name, None)
        if hosted is not None:
            keep = [b for b in hosted if b is not block]
            if len(keep) != len(hosted):
                host._modules[name] = nn.ModuleList(keep)
                found = True
    return found


def hosted_blocks(host: nn.Module) -> dict[str, list[NormalizedResidualBlock]]:
    """The blocks `host` carries, by place: `{"pre": [...], "post": [...]}` (empty lists where none).

    Example:
        ```python
        >>> hosted_blocks(model.model.layers[3])
        {'pre': [], 'post': []}
        ```
    """
    return {where: list(getattr(host, name, [])) for where, name in (("pre", PRE), ("post", POST))}


def strip(layer: nn.Module) -> None:
    """Remove hosted blocks and their hooks (used on a deep copy of a host layer)."""
    for name in (PRE, POST):
        layer._modules.pop(name, None)
    for hooks, fn in ((layer._forward_pre_hooks, _pre_hook), (layer._forward_hooks, _post_hook)):
        for key in [k for k, v in hooks.items() if v is fn]:
            del hooks[key]
            layer._forward_pre_hooks_with_kwargs.pop(key, None)
