"""Model families as data: where each family keeps its layer stack and what makes a block zero.

One row per `config.model_type`, in the manner of mergekit's architecture files: the growth
engine, the probe and the trainer read these rows and never branch on a model class.
"""

from __future__ import annotations

import warnings
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

    def native_is_exact(self, config) -> bool:
        """Whether a native block with zeroed residual outputs is the identity for this config (pre-norm, no index-tied flag)."""
        if self.norm_style != "pre":
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


def resolve_family(model: nn.Module) -> tuple[FamilySpec, nn.ModuleList, str]:
    """Find the family row, the layer stack and its full path for a model.

    Unknown families fall back to a layer stack found by shape (adapter growth only), with a
    warning; a model without a findable stack raises a `ValueError` naming the supported families.
    """
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no `.config`: hf_depthgrow grows Hugging Face `PreTrainedModel`s.")
    model_type = getattr(config, "model_type", None)
    base = getattr(model, "base_model", model)
    prefix = _module_path(model, base)
    spec = FAMILIES.get(model_type)
    if spec is not None:
        stack = _get_submodule(base, spec.layers)
        if isinstance(stack, nn.ModuleList):
            return spec, stack, _join(prefix, spec.layers)
        raise ValueError(
            f"model_type {model_type!r} is listed but `{spec.layers}` is not a layer list on {type(base).__name__}; "
            "this transformers version may lay it out differently."
        )
    found = _guess_layer_stack(base, getattr(config, "num_hidden_layers", None))
    if found is None:
        raise ValueError(
            f"Cannot find a layer stack in {type(model).__name__} (model_type {model_type!r}). "
            f"Supported families: {', '.join(SUPPORTED_FAMILIES)}."
        )
    path, stack = found
    norm = "rms" if any("rms" in type(m).__name__.lower() for m in stack[0].modules()) else "layer"
    eps_key = next((k for k in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps") if hasattr(config, k)), "")
    warnings.warn(
        f"model_type {model_type!r} is not in hf_depthgrow's family table; using the layer stack `{path}` found by shape. "
        "Only adapter blocks are available for it.",
        stacklevel=3,
    )
    spec = FamilySpec(
        model_type=str(model_type), layers=path, kind="unknown", residual_outputs=(), norm=norm, norm_style="unknown", eps_key=eps_key
    )
    return spec, stack, _join(prefix, path)


def _module_path(root: nn.Module, target: nn.Module) -> str:
    if root is target:
        return ""
    for name, module in root.named_modules():
        if module is target:
            return name
    return ""


def _join(prefix: str, path: str) -> str:
    return f"{prefix}.{path}" if prefix else path


def residual_output_modules(spec: FamilySpec, layer: nn.Module) -> list[nn.Module]:
    """The modules of `layer` whose outputs join the residual stream (one per `residual_outputs` entry)."""
    found = []
    for entry in spec.residual_outputs:
        module = next((m for alt in entry.split("|") if (m := _get_submodule(layer, alt)) is not None), None)
        if module is None:
            raise ValueError(f"{spec.model_type}: layer {type(layer).__name__} has none of `{entry}`.")
        found.append(module)
    return found


def model_eps(spec: FamilySpec, config) -> float | None:
    """The family's norm epsilon as the config sets it (`spec.eps_key`), or `None` where it has none.

    Example:
        ```python
        >>> model_eps(FAMILIES["llama"], LlamaConfig(rms_norm_eps=1e-5))
        1e-05
        ```
    """
    return getattr(config, spec.eps_key, None) if spec.eps_key else None
