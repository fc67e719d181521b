"""A family row for a `model_type` the table does not name, inferred from the model itself.

mergekit infers an architecture it has no file for from the weights' names; this module does the
same from the layers' behaviour, on one probe input:

1. it captures the arguments one original layer receives in a forward pass of the model;
2. it traces that layer: every module with weights of its own whose output has the residual width
   (the layer input's last dimension) *writes* the residual width; the last such writer of each
   branch (top-level child: `self_attn`, `mlp`, OPT's `fc2`) is the branch's output projection;
3. it zeroes those (and, while the layer is not yet the identity, further writers: a MoE block's
   expert bank next to its shared expert) and checks that the layer becomes the identity on the
   residual stream; a parameter of a fused expert bank (`experts.down_proj`) is zeroed alone, so
   the expert bank's input projection keeps its values;
4. it finds the attributes that hold a layer's index (`layer_idx`, GPT-Neo's `layer_id`: the
   KV-cache slots growth renumbers) and checks that the layer's output does not depend on them
   (renumbering must not change the originals);
5. it grows the model natively at `[0, L]` in place (`trial.py`) and checks logits and cached
   decoding against the original, and that every layer rebuilt from the grown config (as plain
   transformers rebuilds a checkpoint) has the grown layer's structure; then rolls back.

A family that passes every step gets a `FamilySpec` with `norm_style="pre"`: `auto` grows it
natively and the result is a vanilla checkpoint. Otherwise the spec carries `fallback_reason`
and only adapter blocks are used (`resolve_target` warns with the reason). The result is cached
per `model_type`, per the layer and root classes and per the config's switches (its bool and str
settings: OPT-350m is post-norm, other OPTs pre-norm), so it runs once per family per process.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from . import verify
from .families import INFERRED, FamilySpec
from .layer_probe import capture_call, deviation, first_tensor, is_adapter_name, run_layer, stream, zeroed
from .norms import infer_norm, is_norm
from .record import growth_record

# Config keys that say nothing about the maths, left out of the cache key.
_NOT_SWITCHES = {"_name_or_path", "name_or_path", "transformers_version", "model_type", "problem_type", "tokenizer_class"}
POST_NORM = "post-norm: zeroed branch still normalises (LN(z + 0) != z)"
INDEX_BAKED = "layer index baked into the layer's maths: its output changes with layer_idx (e.g. attention scaled by 1/layer_idx)"


def infer_spec(model: nn.Module, target) -> FamilySpec:
    """The (cached) inferred row for `target`'s stack (`target.spec` is not set yet; see `towers.resolve_target`).

    Example:
        ```python
        >>> spec = resolve_family(tiny_olmo)[0]       # calls this once per process
        >>> spec.inferred, spec.residual_outputs, spec.fallback_reason
        (True, ('self_attn.o_proj', 'mlp.down_proj'), '')
        ```
    """
    key = _cache_key(target)
    if key not in INFERRED:
        try:
            INFERRED[key] = _infer(model, target)
        except Exception as err:  # noqa: BLE001 -- a layer we cannot analyse still grows, with adapter blocks
            INFERRED[key] = FamilySpec(
                model_type=str(getattr(target.config, "model_type", None)), layers=target.layers, kind="unknown",
                residual_outputs=(), norm="layer", norm_style="unknown", eps_key="", inferred=True,
                fallback_reason=f"could not infer the layer's layout ({type(err).__name__}: {err})",
            )
    return INFERRED[key]


def clear_cache() -> None:
    """Forget every inferred row (they are re-inferred on next use)."""
    INFERRED.clear()


def _cache_key(target) -> tuple:
    config = target.config
    switches = tuple(
        sorted((k, v) for k, v in config.to_dict().items() if isinstance(v, (bool, str)) and k not in _NOT_SWITCHES)
    )
    classes = (type(target.root).__qualname__, type(target.stack[0]).__qualname__, target.path.rsplit(".", 1)[0])
    return (getattr(config, "model_type", None), classes, switches)


def _infer(model: nn.Module, target) -> FamilySpec:
    config = target.config
    model_type = str(getattr(config, "model_type", None))
    layer = target.stack[_original_index(model, target)]
    norm, eps_key, offset = infer_norm(layer, config)
    spec = FamilySpec(
        model_type=model_type, layers=target.layers, kind=_kind(target.root, config), residual_outputs=(),
        norm=norm, norm_style="unknown", eps_key=eps_key, gamma_offset=offset, inferred=True,
    )
    reason = _unregistered(model_type, layer)
    if reason:
        return dataclasses.replace(spec, fallback_reason=reason)
    call, reason = capture_call(target.root, layer)
    if call is None:
        return dataclasses.replace(spec, fallback_reason=reason)
    outputs, reason = _residual_outputs(layer, call)
    style = "post" if reason == POST_NORM else ("pre" if not reason else "unknown")
    spec = dataclasses.replace(spec, residual_outputs=tuple(outputs), norm_style=style, index_attrs=_index_attrs(target.stack))
    if not reason:
        missing = _missing_in_other_layers(spec, target.stack)
        reason = missing or (INDEX_BAKED if _depends_on_index(layer, call, spec.index_attrs) else "")
    if not reason:
        from .trial import native_trial  # imported when needed: the trial pulls in the block builders and layout

        reason = native_trial(model, dataclasses.replace(target, spec=spec))
    return dataclasses.replace(spec, fallback_reason=reason)


# ----------------------------------------------------------------------------- what the layer is


def _original_index(model: nn.Module, target) -> int:
    # An already grown model: look at an original layer, not at a native block whose outputs are zero.
    record = growth_record(model)
    if record is None or record.tower != target.tower or len(target.stack) != record.num_layers:
        return 0
    return record.old_indices[0]


def _kind(root: nn.Module, config) -> str:
    if getattr(config, "image_size", None) is not None:
        return "vision"
    can_generate = getattr(root, "can_generate", None)
    if getattr(config, "is_decoder", False) or (callable(can_generate) and can_generate()):
        return "decoder"
    return "encoder"


def _unregistered(model_type: str, layer: nn.Module) -> str:
    """Why plain transformers could not rebuild a native checkpoint of this family, or `""`."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        return (f"model_type {model_type!r} is not registered with transformers (a fork or remote code), so plain "
                "transformers could not rebuild a grown checkpoint")
    module = type(layer).__module__
    if not module.startswith("transformers."):
        return f"its layer class {type(layer).__name__} comes from {module}, not from transformers"
    return ""


# ----------------------------------------------------------------------------- the residual outputs


def _writers(layer: nn.Module, call) -> list[tuple[str, nn.Module]]:
    """Modules with weights of their own whose output has the residual width, in the order their last call returned."""
    width = stream(call).shape[-1]
    returned: list[str] = []
    handles = []
    for name, module in layer.named_modules():
        if not name or is_adapter_name(name) or is_norm(module) or not any(True for _ in module.parameters(recurse=False)):
            continue

        def hook(mod, args, out, name=name):
            t = first_tensor(out)
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == width:
                returned.append(name)

        handles.append(module.register_forward_hook(hook))
    try:
        run_layer(layer, call)
    finally:
        for handle in handles:
            handle.remove()
    last = {name: i for i, name in enumerate(returned)}
    return [(name, layer.get_submodule(name)) for name in sorted(last, key=last.get)]


def _entries(name: str, module: nn.Module) -> list[str]:
    """What zeroing a writer can mean: the whole projection, or one weight tensor of a fused expert bank (last first)."""
    own = dict(module.named_parameters(recurse=False))
    plain = not any(True for _ in module.children()) and isinstance(own.get("weight"), nn.Parameter)
    if plain:
        return [name]
    return [f"{name}.{n}" for n, p in reversed(own.items()) if p.dim() >= 2 and not n.endswith("_bias")]


def _params(layer: nn.Module, entries: list[str]) -> list[nn.Parameter]:
    from .families import _resolve_output

    return [p for e in entries for p in _resolve_output(layer, e)[1]]


def _residual_outputs(layer: nn.Module, call) -> tuple[list[str], str]:
    """The entries whose zeroing makes `layer` the identity on the residual stream, and `""`; or `([], why not)`."""
    writers = _writers(layer, call)
    if not writers:
        return [], f"could not find residual outputs: no module of {type(layer).__name__} writes the residual width"
    tol = verify.TOLERANCES.get(next(layer.parameters()).dtype, 1e-2)
    branches: dict[str, list[tuple[str, nn.Module]]] = {}
    for name, module in writers:
        branches.setdefault(name.split(".")[0], []).append((name, module))
    # mergekit's rule: a branch's output projection is its last writer of the residual width (the
    # latest one that zeroing can silence: an attention module's own `sinks` cannot be).
    chosen = [e for ws in branches.values() if (e := _first_silenced(layer, call, reversed(ws), [])) is not None]
    dev = deviation(layer, call, _params(layer, chosen))
    branch_picks = list(chosen)
    # Not the identity yet: another writer (latest first) that at least halves the gap, such as a MoE
    # block's expert bank beside its shared expert.
    for name, module in reversed(writers):
        if dev <= tol:
            break
        entry = _first_silenced(layer, call, [(name, module)], chosen)
        gap = deviation(layer, call, _params(layer, chosen + [entry])) if entry is not None else dev
        if gap <= 0.5 * dev:
            chosen.append(entry)
            dev = gap
    if dev <= tol:
        order = {name: i for i, (name, _) in enumerate(writers)}
        return sorted(chosen, key=lambda e: order.get(e, order.get(e.rsplit(".", 1)[0], 0))), ""
    if _ends_in_norm(layer, call, _params(layer, branch_picks)):
        return [], POST_NORM
    tried = ", ".join(branch_picks) or ", ".join(n for n, _ in writers)
    return [], f"could not find residual outputs: zeroing {tried} leaves the layer {dev:.3g} away from the identity"


def _first_silenced(layer: nn.Module, call, candidates, taken: list[str]) -> str | None:
    """The first entry of the first writer in `candidates` whose zeroing makes that writer output exactly zero."""
    for name, module in candidates:
        for entry in _entries(name, module):
            if entry not in taken and _silenced(layer, call, module, _params(layer, [entry])):
                return entry
    return None


def _silenced(layer: nn.Module, call, module: nn.Module, params: list[nn.Parameter]) -> bool:
    seen = {}

    def hook(mod, args, out):
        # Measured now: the layer may add to this very tensor in place afterwards (Falcon's `mlp_output += ...`).
        t = first_tensor(out)
        seen["max"] = float(t.detach().abs().max()) if isinstance(t, torch.Tensor) and t.numel() else None

    handle = module.register_forward_hook(hook)
    try:
        with zeroed(params):
            run_layer(layer, call)
    finally:
        handle.remove()
    return seen.get("max") == 0.0


def _ends_in_norm(layer: nn.Module, call, params: list[nn.Parameter]) -> bool:
    """Whether, with `params` zeroed, the layer's output is what its last norm returned (post-norm: LN(z + f(z)))."""
    last = {}

    def hook(mod, args, out):
        t = first_tensor(out)
        last["out"] = t.detach().clone() if isinstance(t, torch.Tensor) else None  # a copy: later in-place adds

    handles = [m.register_forward_hook(hook) for n, m in layer.named_modules() if n and is_norm(m) and not is_adapter_name(n)]
    try:
        with zeroed(params):
            out = run_layer(layer, call)
    finally:
        for handle in handles:
            handle.remove()
    norm_out = last.get("out")
    return isinstance(norm_out, torch.Tensor) and norm_out.shape == out.shape and torch.allclose(norm_out.float(), out, atol=1e-6)


def _missing_in_other_layers(spec: FamilySpec, stack: nn.ModuleList) -> str:
    from .families import residual_output_targets

    for i, layer in enumerate(stack):
        try:
            residual_output_targets(spec, layer)
        except ValueError:
            missing = [e for e in spec.residual_outputs if not _has(layer, e)]
            return f"layers differ in structure (dense and MoE, or attention and recurrent layers): layer {i} has no `{missing[0]}`"
    return ""


def _has(layer: nn.Module, entry: str) -> bool:
    from .families import _resolve_output

    return _resolve_output(layer, entry) is not None


def _int_attr(module: nn.Module, attr: str) -> int | None:
    value = getattr(module, attr, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _index_attrs(stack: nn.ModuleList) -> tuple[str, ...]:
    """`layer_idx` and every other attribute that equals the layer's index in every layer (GPT-Neo's `layer_id`)."""
    if len(stack) < 2:
        return ("layer_idx",)
    names = {k for n, m in stack[1].named_modules() if not is_adapter_name(n) for k in vars(m) if _int_attr(m, k) == 1}
    found = [
        name for name in sorted(names)
        if all(
            any(_int_attr(m, name) is not None for m in layer.modules())
            and all(_int_attr(m, name) in (None, i) for m in layer.modules())
            for i, layer in enumerate(stack)
        )
    ]
    return ("layer_idx", *(n for n in found if n != "layer_idx"))


def _depends_on_index(layer: nn.Module, call, attrs: tuple[str, ...]) -> bool:
    """Whether the layer computes something else once its index attributes change (with no KV cache in play)."""
    indexed = [(m, a) for n, m in layer.named_modules() if not is_adapter_name(n) for a in attrs if _int_attr(m, a) is not None]
    if not indexed:
        return False
    before = run_layer(layer, call)
    saved = [getattr(m, a) for m, a in indexed]
    try:
        for m, a in indexed:
            setattr(m, a, getattr(m, a) + 1)
        after = run_layer(layer, call)
    finally:
        for (m, a), idx in zip(indexed, saved):
            setattr(m, a, idx)
    return not torch.allclose(before, after, atol=1e-6, rtol=0)
