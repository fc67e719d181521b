"""Running one layer of a model on its own, as `inference.py` does to find a family's residual outputs.

The arguments a layer receives (hidden states, masks, rotary embeddings) are captured once from a
forward pass of the whole model on a probe input, without its KV cache; the layer is then run on
them again with some of its weights zeroed in place (and put back exactly), its hosted adapter
blocks off, in eval mode, under a forked RNG, so nothing about the model changes.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from . import adapter, verify


def is_adapter_name(name: str) -> bool:
    """Whether a module name lies inside a hosted adapter block (`...depthgrow_pre.0...`)."""
    return adapter.PRE in name.split(".") or adapter.POST in name.split(".")


class _Stop(Exception):
    """Ends the model's forward pass once the layer's arguments are captured."""


def capture_call(root: nn.Module, layer: nn.Module) -> tuple[tuple | None, str]:
    """`((args, kwargs), "")` of one call of `layer` in a forward pass of `root` on a probe input, or `(None, why)`."""
    captured = {}

    def hook(module, args, kwargs):
        captured["call"] = (args, dict(kwargs))
        raise _Stop

    handle = layer.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
    try:
        inputs = verify.probe_inputs(root, next(root.parameters()).device)
        verify.run_probe(root, inputs)
    except _Stop:
        pass
    except Exception as err:  # noqa: BLE001 -- any failure only means: no native growth
        return None, f"could not run the model on a probe input ({type(err).__name__}: {err})"
    finally:
        handle.remove()
    if "call" not in captured:
        return None, "could not find residual outputs: the layer is never called on a probe input"
    return without_cache(*captured["call"]), ""


def without_cache(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call without its KV cache: one the model made anyway would grow with every run and change the output."""
    from transformers.cache_utils import Cache

    args = tuple(None if isinstance(a, Cache) else a for a in args)
    kwargs = {k: (None if isinstance(v, Cache) else v) for k, v in kwargs.items()}
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    return args, kwargs


def stream(call) -> torch.Tensor:
    """The residual stream entering the layer in a captured call."""
    args, kwargs = call
    return args[0] if args else kwargs["hidden_states"]


def first_tensor(output) -> torch.Tensor | None:
    """The hidden states in a module's output: the tensor itself, the first of a tuple/list, or `last_hidden_state`."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return getattr(output, "last_hidden_state", None) if not isinstance(output, (tuple, list)) else None


@contextlib.contextmanager
def adapters_off(layer: nn.Module):
    """Switch off the adapter blocks `layer` hosts for the duration (a trained adapter is no identity)."""
    hosted = [b for blocks in adapter.hosted_blocks(layer).values() for b in blocks]
    states = [b.enabled for b in hosted]
    try:
        for b in hosted:
            b.enabled = False
        yield
    finally:
        for b, state in zip(hosted, states):
            b.enabled = state


def run_layer(layer: nn.Module, call) -> torch.Tensor:
    """The layer's output hidden states (fp32) on a captured call; the captured input is never written to."""
    args, kwargs = call
    # A copy of the stream: a layer that adds to its input in place must not change the captured call.
    if args:
        args = (args[0].clone(), *args[1:])
    else:
        kwargs = {**kwargs, "hidden_states": kwargs["hidden_states"].clone()}
    with adapters_off(layer), verify._quiet_run(layer):
        return first_tensor(layer(*args, **kwargs)).detach().float().clone()


@contextlib.contextmanager
def zeroed(params: list[nn.Parameter]):
    """Zero `params` in place for the duration, then put their values back exactly."""
    saved = [p.detach().clone() for p in params]
    try:
        with torch.no_grad():
            for p in params:
                p.zero_()
        yield
    finally:
        with torch.no_grad():
            for p, value in zip(params, saved):
                p.copy_(value)


def deviation(layer: nn.Module, call, params: list[nn.Parameter]) -> float:
    """max |layer(z) - z| with `params` zeroed, relative to max(1, max |z|)."""
    z = stream(call).detach().float().clone()
    with zeroed(params):
        out = run_layer(layer, call)
    if out.shape != z.shape:
        return float("inf")
    return float((out - z).abs().max()) / max(1.0, float(z.abs().max()))
