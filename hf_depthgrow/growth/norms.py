"""Normalisation regularity (docs/theory.md §6): every norm of a model, its eps, and the global bound.

`N(z) = gamma * (z - mean) / sqrt(var(z) + eps)` has Jacobian norm at most
`max|gamma| / sqrt(var(z) + eps)`, so `Lip(N) <= max|gamma| / sqrt(eps)`: finite only because
of eps (the "engineering epsilon").
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import asdict, dataclass

import torch
from torch import nn

from .families import known_spec



@dataclass
class NormInfo:
    """One norm module: where it is, what it is, and its Lipschitz bound."""

    name: str
    cls: str
    eps: float
    max_gamma: float
    lipschitz_bound: float
    gamma_offset: float

    def to_dict(self) -> dict:
        return asdict(self)


def check_norm_eps(eps: float, dtype: torch.dtype = torch.float32) -> None:
    """Refuse `eps <= 0`; warn where `dtype` cannot represent eps as a normal number."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps):
        raise ValueError(f"eps must be a finite positive number, got {eps!r}")
    if eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps}: without it the norm is singular at z = 0 (docs/theory.md §6).")
    if dtype.is_floating_point and eps < torch.finfo(dtype).tiny:
        warnings.warn(
            f"eps={eps:g} is below the smallest normal {dtype} ({torch.finfo(dtype).tiny:g}): the dtype cannot resolve it, "
            "so the norm's Lipschitz bound no longer holds as computed.",
            stacklevel=3,
        )


def norm_eps(module: nn.Module) -> float | None:
    """The module's normalisation eps, whatever the family calls it, or `None`."""
    for attr in ("eps", "variance_epsilon", "epsilon"):
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def is_norm(module: nn.Module) -> bool:
    """Whether `module` is a normalisation layer (torch's, or a family's own with an eps)."""
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)):
        return True
    name = type(module).__name__.lower()
    return "norm" in name and norm_eps(module) is not None


def norm_inventory(model: nn.Module) -> list[NormInfo]:
    """Every norm module of `model` with class, eps, max|gamma| and `max|gamma| / sqrt(eps)`.

    Gemma-family RMSNorms scale by `(1 + w)`; their gamma is reported as `1 + w`.

    Example:
        ```python
        >>> rows = norm_inventory(model)
        >>> max(r.lipschitz_bound for r in rows)
        ```
    """
    spec = known_spec(getattr(getattr(model, "config", None), "model_type", None))
    offset = spec.gamma_offset if spec else 0.0
    rows = []
    for name, module in model.named_modules():
        if not is_norm(module):
            continue
        eps = norm_eps(module)
        if eps is None:
            continue
        weight = getattr(module, "weight", None)
        # The family convention applies to the family's own RMSNorm classes, not to torch's
        # nn.RMSNorm used by hf_depthgrow's adapter blocks.
        module_offset = offset if (offset and "rms" in type(module).__name__.lower() and type(module) is not nn.RMSNorm) else 0.0
        if isinstance(weight, torch.Tensor):
            max_gamma = float((weight.detach().float() + module_offset).abs().max())
        else:
            max_gamma = 1.0
        bound = max_gamma / math.sqrt(eps) if eps > 0 else math.inf
        rows.append(NormInfo(name, type(module).__name__, eps, max_gamma, bound, module_offset))
    return rows


def infer_norm(layer: nn.Module, config) -> tuple[str, str, float]:
    """`(norm, eps_key, gamma_offset)` of a layer's first norm, by behaviour, for a family the table does not name.

    `norm` is `"layer"` where the norm centres its input (LN(x) = LN(x - mean)), else `"rms"`;
    `gamma_offset` is 1 where a zero weight still scales by one (Gemma's `(1 + w)`); `eps_key` is
    the config key whose value is the norm's eps (`""` where none is).

    Example:
        ```python
        >>> infer_norm(olmo2.model.layers[0], olmo2.config)
        ('rms', 'rms_norm_eps', 0.0)
        ```
    """
    norm = next((m for n, m in layer.named_modules() if is_norm(m) and "depthgrow_" not in n), None)
    eps = norm_eps(norm) if norm is not None else None
    keys = [k for k, v in config.to_dict().items() if isinstance(v, float) and eps is not None and v == eps]
    eps_key = next((k for k in keys if "eps" in k), keys[0] if keys else "")
    if norm is None:
        return "layer", eps_key, 0.0
    kind, offset = "rms" if "rms" in type(norm).__name__.lower() else "layer", 0.0
    weight = getattr(norm, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 1:
        probe = copy.deepcopy(norm).float().eval()  # probe a copy: the model's norm is not touched
        x = 0.5 * torch.randn(2, 3, weight.shape[0], generator=torch.Generator().manual_seed(0)) + 3.0
        try:
            with torch.no_grad():
                centred = torch.allclose(probe(x), probe(x - x.mean(-1, keepdim=True)), atol=1e-4)
                probe.weight.zero_()
                if isinstance(getattr(probe, "bias", None), torch.Tensor):
                    probe.bias.zero_()
                zero_gain = float(probe(x).abs().max())
        except Exception:  # noqa: BLE001 -- a norm that needs more than its input (a gated norm): keep the name's guess
            return kind, eps_key, offset
        kind = "layer" if centred else "rms"
        offset = 0.0 if zero_gain < 1e-6 else 1.0  # Gemma-style `(1 + w)` scales by 1 at w = 0
    return kind, eps_key, offset
