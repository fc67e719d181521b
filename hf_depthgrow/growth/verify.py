"""The exactness post-check of `grow_depth`: the model before and after, on one tiny input.

Zeroing a block's residual outputs is exact only if nothing else sits in the residual path (a
wrapper, a hook, a quantised kernel). Rather than trust every such case to be caught up front,
`grow_depth` runs the model once before and once after growing, on a probe input built from the
config (batch 1, a few tokens or one image), and rolls back when they differ by more than the
dtype's tolerance. Both runs leave the RNG state, every module's train/eval mode and the KV
caches as they were: they run in eval mode, under a forked RNG, with `use_cache=False`.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings

import torch
from torch import nn

# Allowed max |after - before|, relative to max(1, max |before|). The grown model at init is
# exact up to float reassociation at most; these bounds sit well above that and well below any
# real change (a wrapped projection moved fp32 logits by ~0.2).
TOLERANCES = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}
PROBE_TOKENS = 8


class GrowthNotExactError(ValueError):
    """The grown model does not compute what the original did on the probe input; the growth was rolled back."""


def probe_inputs(model: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """Batch-1 inputs built from the config alone: one image for vision models, a few token ids otherwise.

    A config that nests a text and a vision sub-config (CLIP, SigLIP, vision-language models)
    gets both, and, where the config names an image token, as many image tokens as the model's
    `get_image_features` returns features for the one image.
    """
    config = model.config
    generator = torch.Generator().manual_seed(0)  # its own generator: the global RNG is not drawn from
    text, vision = _modalities(config)
    if text is None and vision is None:
        raise ValueError("the config has neither image_size nor vocab_size to build a probe input from")
    inputs = {}
    if vision is not None:
        size = vision.image_size
        h, w = (size, size) if isinstance(size, int) else tuple(size)[:2]
        pixels = torch.randn(1, getattr(vision, "num_channels", 3), h, w, generator=generator)
        inputs["pixel_values"] = pixels.to(device=device, dtype=_dtype(model))
    if text is None:
        return inputs
    vocab = text.vocab_size
    ids = torch.randint(min(2, vocab - 1), vocab, (1, PROBE_TOKENS), generator=generator)
    image_token = next((getattr(config, k) for k in ("image_token_id", "image_token_index") if isinstance(getattr(config, k, None), int)), None)
    if vision is not None and image_token is not None:
        count = _image_token_count(model, inputs["pixel_values"], text)
        ids = torch.cat([torch.full((1, count), image_token), ids.masked_fill(ids == image_token, min(2, vocab - 1))], dim=1)
    ids = ids.to(device)
    return {**inputs, "input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _modalities(config) -> tuple[object | None, object | None]:
    """`(text config, vision config)`: the config itself where it has `vocab_size` / `image_size`, else its sub-configs."""
    subs = {k: v for k, v in vars(config).items() if k.endswith("_config") and hasattr(v, "to_dict")}
    if getattr(config, "image_size", None) is not None:
        return None, config  # a vision model: one image, as before
    text = config if isinstance(getattr(config, "vocab_size", None), int) else subs.get("text_config")
    vision = subs.get("vision_config")
    vision = vision if getattr(vision, "image_size", None) is not None else None
    text = text if isinstance(getattr(text, "vocab_size", None), int) and text.vocab_size > 0 else None
    return text, vision


def _image_token_count(model: nn.Module, pixels: torch.Tensor, text) -> int:
    # How many placeholder tokens one image fills: the model's own image features, counted in text-width vectors.
    with _quiet_run(model):
        features = model.get_image_features(pixel_values=pixels)
    features = getattr(features, "pooler_output", features)
    if isinstance(features, (list, tuple)):
        features = torch.cat([f.reshape(-1) for f in features])
    return int(features.numel() // text.hidden_size)


def _dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _devices(model: nn.Module) -> list[int]:
    return sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})


@contextlib.contextmanager
def _quiet_run(model: nn.Module):
    """Eval mode, no grad, forked RNG for the duration; every module's own mode restored after."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        with torch.random.fork_rng(devices=_devices(model)), torch.no_grad():
            model.eval()
            yield
    finally:
        for module, training in modes:
            module.training = training


def _signal(output) -> torch.Tensor:
    # What the model's head returns: logits where it has a head, else the last hidden state.
    for key in ("logits", "last_hidden_state", "pooler_output"):
        value = getattr(output, key, None) if not isinstance(output, dict) else output.get(key)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(output, torch.Tensor):
        return output
    first = output[0] if isinstance(output, (tuple, list)) else None
    if isinstance(first, torch.Tensor):
        return first
    raise ValueError(f"cannot find a tensor in the model's output ({type(output).__name__})")


def run_probe(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's output on `inputs` in fp32, without touching RNG, modes or caches."""
    kwargs = dict(inputs)
    if "use_cache" in inspect.signature(model.forward).parameters:
        kwargs["use_cache"] = False
    with _quiet_run(model):
        return _signal(model(**kwargs)).detach().float()


def reference(model: nn.Module, *, warn: bool = True) -> tuple[dict, torch.Tensor] | None:
    """`(inputs, output)` of the model before growing, or `None` (with a warning unless `warn=False`) where it cannot be run."""
    try:
        device = next(model.parameters()).device
        inputs = probe_inputs(model, device)
        output = run_probe(model, inputs)
    except Exception as err:  # a model we cannot run is grown unchecked, but not silently
        if not warn:
            return None
        warnings.warn(
            f"grow_depth could not run {type(model).__name__} on a probe input ({type(err).__name__}: {err}), so "
            "exactness is not checked; pass verify=False to skip the check on purpose.",
            stacklevel=3,
        )
        return None
    check_finite(model, output)
    return inputs, output


def check_finite(model: nn.Module, output: torch.Tensor) -> None:
    """Raise `GrowthNotExactError` naming the NaN/inf parameters if the model's output before growing is not finite.

    A NaN compares false with any tolerance, so the exactness check alone would call such a growth exact. The
    message offers no way around the check: every command would only train and score a model whose losses are NaN.
    """
    if bool(output.isfinite().all()):
        return
    names = [name for name, p in model.named_parameters() if p.is_floating_point() and not bool(p.isfinite().all())]
    where = f"{len(names)} parameter(s) hold NaN or inf, e.g. {', '.join(names[:3])}" if names else "its parameters are finite"
    raise GrowthNotExactError(
        f"the model's output on a probe input is not finite ({where}): a broken model is not grown (nothing was "
        "changed). Reload the model from its source, or repair or replace its weights file, and run again."
    )


def check_exact(model: nn.Module, inputs: dict, before: torch.Tensor, dtype: torch.dtype, *, bitwise: bool = False) -> None:
    """Raise `GrowthNotExactError` with the measured max |diff| if the grown model's output moved or is not finite.

    `bitwise=True` allows no difference at all: a quantised base runs the very same kernels on the very
    same inputs after growing, and its new blocks add exactly 0, so any change at all is a fault.
    """
    after = run_probe(model, inputs)
    if after.shape != before.shape:
        raise GrowthNotExactError(f"the grown model's output shape {tuple(after.shape)} != the original's {tuple(before.shape)}")
    diff = float((after - before).abs().max()) if after.isfinite().all() else float("nan")
    tol = 0.0 if bitwise else TOLERANCES.get(dtype, 1e-2) * max(1.0, float(before.abs().max()))
    if not diff <= tol:  # NaN fails too
        kind = "quantised base, bit for bit" if bitwise else str(dtype)
        raise GrowthNotExactError(
            f"the grown model is not exact: max |diff| {diff:.3g} > tolerance {tol:.3g} ({kind}) on a probe input, so "
            "the growth was rolled back. Something in the residual path (a wrapper, a hook, a custom layer) is not "
            "silenced by zeroing its weights: try block='adapter'; verify=False skips this check."
        )
