"""The last step of inferring a family: grow it natively for real, check, and roll back.

`inference.py` finds a layer's residual outputs on one layer. Whether a native block is exact in
the whole model also depends on what the model does around its layers: a mask or a cache slot
picked by the layer's position, per-layer config lists, a head that reads a layer by index. So
`native_trial` inserts native blocks at `[0, L]` (every original layer moves, and a block sits
on top) and compares, on a probe input, the model's output and (for generative models) greedy
decoding with the KV cache, past the sliding window where the window is short. It then rebuilds
every layer of the grown config on the meta device, as plain transformers does when it loads a
checkpoint, and compares parameter shapes and per-layer attributes with the grown layers: a
family whose layer structure follows its index (MoE every n-th layer, dense first layers) would
not reload. Whatever happens, the model is restored exactly (`layout.Snapshot`).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from . import adapter, verify
from .blocks import _construct_layer, _param_like, build_blocks
from .config import GrowthConfig
from .layout import _insert_native, Snapshot
from .placement import resolve_positions

DECODE_STEPS = 4
_SKIP_ATTRS = {"training"}  # index attributes are compared too: a rebuilt layer i must have them equal to i


def native_trial(model: nn.Module, target) -> str:
    """`""` when native blocks at `[0, L]` leave `target.root`'s output and cached decoding exact, else why not.

    Example:
        ```python
        >>> native_trial(model, target)          # target.spec is the candidate inferred row
        ''
        ```
    """
    runner, stack = target.root, target.stack
    like = _param_like(stack[0])
    tol = verify.TOLERANCES.get(like.dtype, 1e-2)
    try:
        inputs = verify.probe_inputs(runner, like.device)
        before = verify.run_probe(runner, inputs)
        decoded = _original_decoding(runner, inputs, target.config)
        entries = resolve_positions([0, len(stack)], len(stack))
        blocks = build_blocks(model, stack, target.spec, "native", entries, GrowthConfig(block="native", verify=False),
                              stack_config=target.config)
    except Exception as err:  # noqa: BLE001 -- a model we cannot probe is not grown natively
        return f"could not run a native growth trial ({type(err).__name__}: {err})"
    snapshot = Snapshot.take(model, stack, target)
    try:
        _insert_native(model, stack, blocks, snapshot)
        moved = _relative_diff(verify.run_probe(runner, inputs), before)
        if not moved <= tol:
            return f"native growth moved the output by {moved:.3g} (relative) on a probe input"
        if decoded is not None:
            moved = _relative_diff(_decode(runner, inputs, target.config), decoded)
            if not moved <= tol:
                return f"native growth moved greedy decoding with the KV cache by {moved:.3g} (relative)"
        mismatch = _rebuilt_mismatch(stack, target.config)
        if mismatch:
            return f"a layer's construction depends on its index, so a saved checkpoint would not reload as grown: {mismatch}"
    except Exception as err:  # noqa: BLE001
        return f"native growth trial failed ({type(err).__name__}: {err})"
    finally:
        snapshot.restore(model, stack)
    return ""


def _relative_diff(after: torch.Tensor, before: torch.Tensor) -> float:
    if after.shape != before.shape:
        return float("inf")
    return float((after - before).abs().max()) / max(1.0, float(before.abs().max()))


def _original_decoding(runner: nn.Module, inputs: dict, config) -> torch.Tensor | None:
    # A model that cannot decode from the probe prompt as it is gives nothing to compare with: the
    # cache check is skipped (its logits are still checked), rather than refusing native growth.
    try:
        return _decode(runner, inputs, config)
    except Exception:  # noqa: BLE001
        return None


def _decode(runner: nn.Module, inputs: dict, config) -> torch.Tensor | None:
    """Logits of greedy decoding with the KV cache from the probe prompt, or `None` for a model that does not generate."""
    can_generate = getattr(runner, "can_generate", None)
    if not (callable(can_generate) and can_generate()) or "input_ids" not in inputs:
        return None
    window = getattr(config, "sliding_window", None)
    prompt = inputs["input_ids"].shape[1]
    steps = max(DECODE_STEPS, window + 2 - prompt) if isinstance(window, int) and 0 < window <= 64 else DECODE_STEPS
    pad = next((v for v in (getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None), 0) if isinstance(v, int)), 0)
    with verify._quiet_run(runner), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # generation-config notices about flags this probe does not use
        out = runner.generate(
            input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask"), max_new_tokens=steps,
            min_new_tokens=steps, do_sample=False, num_beams=1, use_cache=True, output_logits=True,
            return_dict_in_generate=True, pad_token_id=pad,
        )
    return torch.stack(list(out.logits)).float()


def _shapes(layer: nn.Module) -> dict[str, tuple]:
    return {n: tuple(p.shape) for n, p in layer.named_parameters() if adapter.PRE not in n and adapter.POST not in n}


def _attrs(layer: nn.Module) -> dict[tuple[str, str], object]:
    simple = (bool, int, float, str, type(None))
    return {
        (name, key): value
        for name, module in layer.named_modules()
        if adapter.PRE not in name and adapter.POST not in name
        for key, value in vars(module).items()
        if not key.startswith("_") and key not in _SKIP_ATTRS and isinstance(value, simple)
    }


def _rebuilt_mismatch(stack: nn.ModuleList, config) -> str:
    """How layer i rebuilt from `config` (on the meta device) differs from the grown layer i, or `""`."""
    for i, layer in enumerate(stack):
        try:
            with torch.device("meta"), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fresh = _construct_layer(type(layer), config, i)
        except Exception:  # noqa: BLE001 -- a constructor we cannot call here: the output checks stand alone
            return ""
        grown, built = _shapes(layer), _shapes(fresh)
        if grown != built:
            diff = sorted(set(grown.items()) ^ set(built.items()))[:2]
            return f"layer {i} rebuilt from the config differs in {diff}"
        grown_attrs, built_attrs = _attrs(layer), _attrs(fresh)
        for key in sorted(set(grown_attrs) & set(built_attrs)):
            a, b = grown_attrs[key], built_attrs[key]
            if a != b and not (a != a and b != b):  # NaN equals NaN here
                where = f"{key[0]}.{key[1]}" if key[0] else key[1]
                return f"layer {i} rebuilt from the config has {where}={built_attrs[key]!r}, the grown layer {grown_attrs[key]!r}"
    return ""
