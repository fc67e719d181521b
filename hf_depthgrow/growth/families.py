"""Model families as data: where each family keeps its layer stack and what makes a block zero.

One row per `config.model_type`, in the manner of mergekit's architecture files: the growth
engine, the probe and the trainer read these rows and never branch on a model class.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn


@dataclass(frozen=True)
class FamilySpec:
    """How one model family is laid out.

    Args:
        model_type: `config.model_type` of the family.
        layers: Path of the `nn.ModuleList` of residual layers, relative to `model.base_model`.
        kind: `"decoder"`, `"encoder"` or `"vision"`; decides the default loss of the probe and evaluator.
        residual_outputs: Sub-modules of one layer whose outputs are added to the residual stream.
            Zeroing their weights and biases makes the layer the identity (pre-norm families).
            `"a|b"` lists alternatives (DINOv2's MLP is `fc2` or SwiGLU `down_proj`).
        norm: `"rms"` or `"layer"`: the normalisation an adapter block uses in this family.
        norm_style: `"pre"` (residual stream never normalised in place: native blocks are exact)
            or `"post"` (BERT-style `LN(z + f(z))`: a zero branch still normalises, so only
            adapter blocks are exact).
        eps_key: Config key holding the family's norm epsilon.
        gamma_offset: Added to a norm weight to get its scale (Gemma's `(1 + w)` convention).
        inexact_if: Config flags that, when truthy, make renumbering layers change the maths
            (GPT-2 scales attention by the inverse layer index), so native growth is not exact.
        inferred: `True` for a row `hf_depthgrow.growth.inference` worked out for a family the table
            does not name (from the layer's modules and runs on a probe input).
        fallback_reason: Why native blocks are not exact for this family (empty when they are):
            set by the inference, e.g. `"post-norm: zeroed branch still normalises"`.
        index_attrs: Module attributes that hold the layer's index (its KV-cache slot), renumbered
            when native blocks take a slot: `layer_idx`, plus e.g. GPT-Neo's `layer_id` (inferred).
    """

    model_type: str
    layers: str
    kind: str
    residual_outputs: tuple[str, ...]
    norm: str
    norm_style: str
    eps_key: str
    gamma_offset: float = 0.0
    inexact_if: tuple[str, ...] = field(default_factory=tuple)
    inferred: bool = False
    fallback_reason: str = ""
    index_attrs: tuple[str, ...] = ("layer_idx",)

    def native_is_exact(self, config) -> bool:
        """Whether a native block with zeroed residual outputs is the identity for this config (pre-norm, no index-tied flag)."""
        if self.norm_style != "pre" or self.fallback_reason or not self.residual_outputs:
            return False
        return not any(getattr(config, flag, False) for flag in self.inexact_if)


_LLAMA_LIKE = dict(
    layers="layers",
    kind="decoder",
    residual_outputs=("self_attn.o_proj", "mlp.down_proj"),
    norm="rms",
    norm_style="pre",
    eps_key="rms_norm_eps",
)
_BERT_LIKE = dict(
    layers="encoder.layer",
    kind="encoder",
    residual_outputs=("attention.output.dense", "output.dense"),
    norm="layer",
    norm_style="post",
    eps_key="layer_norm_eps",
)
_VIT_LIKE = dict(
    layers="layers",
    kind="vision",
    residual_outputs=("attention.o_proj", "mlp.fc2"),
    norm="layer",
    norm_style="pre",
    eps_key="layer_norm_eps",
)

FAMILIES: dict[str, FamilySpec] = {
    spec.model_type: spec
    for spec in [
        FamilySpec("llama", **_LLAMA_LIKE),
        FamilySpec("mistral", **_LLAMA_LIKE),
        FamilySpec("qwen2", **_LLAMA_LIKE),
        FamilySpec("qwen3", **_LLAMA_LIKE),
        FamilySpec("phi3", **_LLAMA_LIKE),
        FamilySpec("gemma", **_LLAMA_LIKE, gamma_offset=1.0),
        FamilySpec("gemma2", **_LLAMA_LIKE, gamma_offset=1.0),
        FamilySpec("gemma3_text", **_LLAMA_LIKE, gamma_offset=1.0),
        FamilySpec(
            "gpt2",
            layers="h",
            kind="decoder",
            residual_outputs=("attn.c_proj", "mlp.c_proj"),
            norm="layer",
            norm_style="pre",
            eps_key="layer_norm_epsilon",
            inexact_if=("scale_attn_by_inverse_layer_idx",),
        ),
        FamilySpec(
            "gpt_neox",
            layers="layers",
            kind="decoder",
            residual_outputs=("attention.dense", "mlp.dense_4h_to_h"),
            norm="layer",
            norm_style="pre",
            eps_key="layer_norm_eps",
        ),
        FamilySpec("bert", **_BERT_LIKE),
        FamilySpec("roberta", **_BERT_LIKE),
        FamilySpec("vit", **_VIT_LIKE),
        FamilySpec("deit", **_VIT_LIKE),
        FamilySpec(
            "dinov2",
            **{**_VIT_LIKE, "layers": "encoder.layer", "residual_outputs": ("attention.o_proj", "mlp.fc2|mlp.down_proj")},
        ),
    ]
}

SUPPORTED_FAMILIES = tuple(sorted(FAMILIES))


def _get_submodule(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


def _guess_layer_stack(base: nn.Module, num_layers: int | None) -> tuple[str, nn.ModuleList] | None:
    """The longest `ModuleList` of same-class modules, preferring one as long as the config says."""
    best = None
    for name, module in base.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if len({type(m) for m in module}) != 1:
            continue
        score = (len(module) == num_layers, len(module))
        if best is None or score > best[0]:
            best = (score, name, module)
    if best is None:
        return None
    return best[1], best[2]


def _module_path(root: nn.Module, target: nn.Module) -> str:
    if root is target:
        return ""
    for name, module in root.named_modules():
        if module is target:
            return name
    return ""


def _join(prefix: str, path: str) -> str:
    return f"{prefix}.{path}" if prefix else path


def _resolve_output(layer: nn.Module, path: str) -> tuple[nn.Module, list[nn.Parameter]] | None:
    """`(module, parameters to zero)` for one residual output path, or `None` where `layer` has no such path.

    A path names a module (a projection: all its own weights and biases are zeroed) or a
    parameter of a module (a fused MoE expert bank's `experts.down_proj`: that tensor and its
    `down_proj_*` bias are zeroed, the `gate_up_proj` before it keeps its values).
    """
    module = _get_submodule(layer, path)
    if module is not None:
        return module, list(module.parameters(recurse=False))
    owner_path, _, name = path.rpartition(".")
    owner = _get_submodule(layer, owner_path) if owner_path else layer
    if owner is None or not isinstance(getattr(owner, name, None), nn.Parameter):
        return None
    return owner, [p for n, p in owner.named_parameters(recurse=False) if n == name or n.startswith(f"{name}_")]


def residual_output_targets(spec: FamilySpec, layer: nn.Module) -> list[tuple[str, nn.Module, list[nn.Parameter]]]:
    """`(entry, module, parameters)` for every `residual_outputs` entry: what a native block zeroes.

    Example:
        ```python
        >>> [(e, len(ps)) for e, _, ps in residual_output_targets(FAMILIES["llama"], model.model.layers[0])]
        [('self_attn.o_proj', 1), ('mlp.down_proj', 1)]
        ```
    """
    found = []
    for entry in spec.residual_outputs:
        hit = next((r for alt in entry.split("|") if (r := _resolve_output(layer, alt)) is not None), None)
        if hit is None:
            raise ValueError(f"{spec.model_type}: layer {type(layer).__name__} has none of `{entry}`.")
        found.append((entry, *hit))
    return found


def residual_output_modules(spec: FamilySpec, layer: nn.Module) -> list[nn.Module]:
    """The modules of `layer` whose outputs join the residual stream (one per `residual_outputs` entry).

    For an entry that names a parameter (a fused expert bank's `experts.down_proj`) it is the
    module that holds the parameter.
    """
    return [module for _, module, _ in residual_output_targets(spec, layer)]


def model_eps(spec: FamilySpec, config) -> float | None:
    """The family's norm epsilon as the config sets it (`spec.eps_key`), or `None` where it has none.

    Example:
        ```python
        >>> model_eps(FAMILIES["llama"], LlamaConfig(rms_norm_eps=1e-5))
        1e-05
        ```
    """
    return getattr(config, spec.eps_key, None) if spec.eps_key else None


# Rows inferred in this process for model types the table does not name (`inference.infer_spec` fills it).
INFERRED: dict[tuple, FamilySpec] = {}


def known_spec(model_type: str | None) -> FamilySpec | None:
    """The table row for `model_type`, else a row inferred for it in this process, else `None` (nothing is run).

    Example:
        ```python
        >>> known_spec("llama").residual_outputs
        ('self_attn.o_proj', 'mlp.down_proj')
        ```
    """
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    return next((spec for key, spec in INFERRED.items() if key[0] == model_type), None)
