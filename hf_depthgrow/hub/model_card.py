"""Model cards for grown models: what was grown, where and why, how it was trained, what it is worth.

The card is `model_cards/grown_model.md`, a Jinja template rendered by huggingface_hub's own
`ModelCard.from_template`, so its metadata header is written by `ModelCardData` and parses back on
the Hub. Every section is optional except the base model: a section that was not run says so in
one sentence. The exact configuration of the run is embedded as YAML, so the card reproduces it
(mergekit's habit), and the framework versions are collected automatically.

This module finds the template and renders it; `card_info` holds `CardInfo`, `card_metadata` the
metadata header and its validation (see its docstring for the metadata rules), `card_sections`
the sections.
"""

from __future__ import annotations

import json
import os
import re
import site
import sys
import sysconfig
from pathlib import Path
from typing import Mapping

import yaml
from huggingface_hub import ModelCard

from ..evaluation.formatting import public_name, scrub_paths
from .card_info import CardInfo, as_card_info, card_title, head_of, hub_link, looks_like_hub_id
from .card_metadata import card_metadata, framework_versions, library_name, split_datasets, validate_card_metadata
from .card_sections import evaluation_section, growth_section, plain, probe_section, selection_section, training_section

__all__ = [
    "CardInfo",
    "card_context",
    "card_metadata",
    "find_template",
    "framework_versions",
    "render_model_card",
    "template_candidates",
    "validate_card_metadata",
]

TEMPLATE_NAME = "grown_model.md"


def template_candidates() -> list[Path]:
    """Where `grown_model.md` is looked for, in order (the first that exists wins).

    1. a source checkout: `<repo>/model_cards/` beside the `hf_depthgrow` package (editable installs);
    2. package data: `hf_depthgrow/model_cards/`;
    3. installed data files: `<prefix>/share/hf_depthgrow/model_cards/` for the environment's prefixes
       and the user base (`pip install --user`).
    """
    package = Path(__file__).resolve().parents[1]  # hf_depthgrow/, above hub/
    root = package.parent
    candidates = []
    # Only a real checkout: beside site-packages, a stray top-level `model_cards/` may belong to anyone.
    if (root / "pyproject.toml").is_file():
        candidates.append(root / "model_cards" / TEMPLATE_NAME)
    candidates.append(package / "model_cards" / TEMPLATE_NAME)
    prefixes = [sys.prefix, sys.exec_prefix, sysconfig.get_path("data"), getattr(site, "USER_BASE", None)]
    for prefix in dict.fromkeys(p for p in prefixes if p):
        candidates.append(Path(prefix) / "share" / "hf_depthgrow" / "model_cards" / TEMPLATE_NAME)
    return candidates


def find_template() -> Path:
    """The path of the default card template (see `template_candidates` for the order)."""
    candidates = template_candidates()
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"model card template {TEMPLATE_NAME} not found; looked in: {', '.join(str(p) for p in candidates)}. "
        "Pass template_path= or reinstall hf_depthgrow."
    )


def _base_text(info: CardInfo) -> dict:
    base, hub_id = info.base_model, info.base_model_id
    if hub_id:
        # The Hub id is what a reader can follow; a local copy is named by its folder (a card is public).
        local = public_name(base) if base else hub_id
        copy = "" if local == hub_id else f" (grown from its local copy `{local}`)"
        return {"text": hub_link(hub_id) + copy, "hub_id": hub_id}
    if base and looks_like_hub_id(base):
        return {"text": hub_link(base), "hub_id": base}
    if base:
        return {"text": f"a local checkpoint at `{public_name(base)}` (not a Hub id, so not in the metadata)", "hub_id": None}
    return {"text": "not recorded", "hub_id": None}


def _details(info: CardInfo, base: dict, library: str) -> dict:
    """Title, summary and the rows of the "Model details" table."""
    record = info.growth_record or None
    native = len(record.native_indices) if record else 0
    adapters = len(record.adapters) if record else 0
    if record:
        layers = f"{record.base_num_layers} → {record.num_layers}"
        blocks = ", ".join(x for x in (f"{native} native" if native else "", f"{adapters} adapter" if adapters else "") if x) or "none"
        summary = (
            f"This model is {base['text']} grown in depth with hf_depthgrow: {native + adapters} zero-initialised residual "
            f"block(s) ({blocks}) were inserted, so at insertion it computed exactly what the base model computes."
        )
    else:
        layers, blocks = "not recorded", "none recorded"
        summary = f"This model card describes {base['text']}; it carries no hf_depthgrow growth record."
    if info.adapters_only:
        summary += " This repository holds only the new blocks; the base weights are loaded from the base model."
    if library == "hf_depthgrow":
        library_text = "`hf_depthgrow` (adapter blocks: load with `hf_depthgrow.load_pretrained`)"
    elif record:
        library_text = "`transformers` (native blocks: an ordinary checkpoint of its architecture)"
    else:
        library_text = "`transformers`"
    if info.license:
        named = f" ({info.license_name})" if info.license_name else ""
        license_text = f"`{info.license}`{named}" + (f", inherited from the base model: read from {info.license_source}" if info.license_source else "")
    else:
        where = f" ({hub_link(base['hub_id'])})" if base["hub_id"] else ""
        license_text = f"not given: a grown model inherits the license of its base model{where}; check it before use"
    return {
        "title": card_title(info),
        "summary": summary,
        "description": info.description,
        "base": base,
        "architecture": f"`{(info.architectures or ['unknown'])[0]}`",
        "model_type": info.model_type or "unknown",
        "layers": layers,
        "blocks": blocks,
        "library_text": library_text,
        "license_text": license_text,
    }


def _reproduction(info: CardInfo) -> dict:
    """Data, command, the embedded config and growth record, and the framework versions."""
    record = info.growth_record or None
    hub_data, local_data = split_datasets(info.datasets)
    config = plain(info.config, finite=False) if info.config is not None else None
    config_yaml = yaml.safe_dump(config, sort_keys=False, allow_unicode=True, default_flow_style=False) if config is not None else None
    # A fence longer than any backtick run inside keeps the YAML verbatim whatever strings it holds.
    longest = max((len(m) for m in re.findall(r"`+", config_yaml or "")), default=0)
    versions = info.framework_versions or framework_versions()
    return {
        "data_lines": [f"{hub_link(d, 'datasets')} (Hub data set)" for d in hub_data] + local_data,
        "command": info.command,
        "config_yaml": config_yaml,
        "config_fence": "`" * max(3, longest + 1),
        "growth_record_json": json.dumps(record.to_dict(), indent=2, sort_keys=True) if record else None,
        "growth_record_file": "depthgrow_adapters.json" if info.adapters_only else "config.json",
        "framework_versions": [(k, v) for k, v in versions.items()],
        "hf_depthgrow_version": versions.get("hf_depthgrow", ""),
    }


def card_context(info: "CardInfo | Mapping") -> dict:
    """The variables the template is rendered with (every one always present; `None` = not run).

    Example:
        ```python
        >>> card_context({"base_model": "gpt2", "architectures": ["GPT2LMHeadModel"]})["load"]["auto_class"]
        'AutoModelForCausalLM'
        ```
    """
    info = as_card_info(info)
    base = _base_text(info)
    library = library_name(info)
    load = {
        "kind": "adapters_only" if info.adapters_only else ("transformers" if library == "transformers" else "hf_depthgrow"),
        "auto_class": head_of(info.architectures)[1],
        "source": info.repo_id or "path/to/this/model",
        "base": base["hub_id"] or info.base_model or "the base model",  # plain text: it sits in a code comment
    }
    sections = {
        "growth": growth_section(info.growth_record or None),
        "probe": probe_section(info.probe),
        "training": training_section(info.training),
        "evaluation": evaluation_section(info.evaluation),
        "selection": selection_section(info.selection, info.training),
    }
    context = {**_details(info, base, library), "load": load, **sections, **_reproduction(info)}
    # A card is public: local absolute paths (home, cache, temp folders) become a Hub id or a folder name.
    return scrub_paths(context)


def render_model_card(info: "CardInfo | Mapping", *, template_path: str | os.PathLike | None = None) -> ModelCard:
    """Render the model card of a grown model with huggingface_hub's `ModelCard.from_template`.

    Args:
        info: A `CardInfo`, or a dict of its fields. Result objects (`ProbeResult`, `TrainResult`,
            `EvalResult`) may be passed as they are.
        template_path: A Jinja template to use instead of `model_cards/grown_model.md`; it receives
            `card_data` (the YAML header) and the variables of `card_context(info)`.

    Returns:
        `huggingface_hub.ModelCard`: `card.data` holds the metadata, `card.save("README.md")` writes it.

    Example:
        ```python
        >>> from hf_depthgrow.hub.model_card import render_model_card
        >>> card = render_model_card({
        ...     "base_model": "HuggingFaceTB/SmolLM2-135M", "model_type": "llama",
        ...     "architectures": ["LlamaForCausalLM"], "growth_record": growth_record(model),
        ...     "evaluation": eval_result, "config": {"grow": {"positions": [15]}}, "license": "apache-2.0",
        ... })
        >>> card.save("grown/README.md")
        ```
    """
    info = as_card_info(info)
    path = Path(template_path) if template_path is not None else find_template()
    card = ModelCard.from_template(card_metadata(info), template_path=str(path), **card_context(info))
    return card
