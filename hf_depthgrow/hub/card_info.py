"""`CardInfo`: everything a grown model's card can say, how Hub ids are told from local paths, and the license
a grown model inherits (`inherited_license`: read from its base model's card or config, offline, never guessed).

Only `base_model` is needed; every other field is optional and a section that was not run says
so in one sentence. `growth_record` is always a typed `GrowthRecord` (a stored dict is converted).

A grown model is a derivative of its base model, so its card carries the base's license when the user
gives none. Where it is read, in order (the first that names a valid license id wins):

1. a local base folder's `README.md` metadata (`license`, with `license_name` / `license_link` for `other`);
2. the embedded SmolLM2 copy (`hf_depthgrow.load_model("smollm2")`): the `general.license` field of the GGUF
   file it was built from (its config; the cache folder has no card);
3. a Hub id: the base's `README.md` when the local Hub cache holds it (no network call is made).

Nothing found means no `license` in the metadata, and the card says the license is inherited but unknown.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Mapping

from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from ..growth.record import GrowthRecord, growth_record

# A name with one of these endings is a file, even where it would also parse as a repo id.
FILE_SUFFIXES = {".txt", ".csv", ".tsv", ".json", ".jsonl", ".parquet", ".arrow", ".gz", ".zip", ".npy", ".npz", ".md"}
# Head class suffix -> (pipeline_tag, Auto class): the Hub's task for the widget, and how to load it.
HEADS = (
    ("ForCausalLM", "text-generation", "AutoModelForCausalLM"),
    ("LMHeadModel", "text-generation", "AutoModelForCausalLM"),
    ("ForSequenceClassification", "text-classification", "AutoModelForSequenceClassification"),
    ("ForTokenClassification", "token-classification", "AutoModelForTokenClassification"),
    ("ForQuestionAnswering", "question-answering", "AutoModelForQuestionAnswering"),
    ("ForMaskedLM", "fill-mask", "AutoModelForMaskedLM"),
    ("ForImageClassification", "image-classification", "AutoModelForImageClassification"),
)
# A Hub license id ("apache-2.0", "mit", "other").
LICENSE_RE = re.compile(r"^[a-z0-9][a-z0-9.+_-]*$")
# The Hub cache stores a repository as `.../models--owner--name/snapshots/<rev>`: that is its Hub id.
_HUB_CACHE_REPO = re.compile(r"models--([\w.-]+?)--([\w.-]+?)(?:/|$)")


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
            `intervals` (`{name: (low, high)}`), `confidence`, `verdict`, ...; a dict may also carry `control`
            (the equal-parameter control, as `hf-depthgrow run`'s `summary.json` holds it) and `retention`
            (forgetting on a general-domain set), each with a `sentence` the section prints first.
        selection: The fallback rule: `selected` (`"new"`, `"stepping_stone"` or `"old"`), `delta_erm`,
            `reference`, `train_losses`. Taken from `training` when that holds them.
        config: The exact configuration that reproduces the run (embedded as YAML).
        command: The command line of the run.
        datasets: Data sets used: Hub ids go into the metadata, local paths and embedded corpora into the text.
        license: License id (e.g. `"apache-2.0"`). When not given, the base model's is inherited where it can be
            read offline (`inherited_license`: a local base folder's README.md, the embedded
            SmolLM2's GGUF metadata, a Hub card in the local Hub cache); else omitted from the metadata.
        license_name: Name of an `other` license (the Hub needs it with `license: other`).
        license_link: Link to an `other` license's text.
        license_source: Where an inherited license was read (set when it is inherited; `None` when given).
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
    license: str | None = field(default=None, metadata={"help": "License id; default: the base model's, where it can be read."})
    license_name: str | None = field(default=None, metadata={"help": "Name of an 'other' license."})
    license_link: str | None = field(default=None, metadata={"help": "Link to an 'other' license's text."})
    license_source: str | None = field(default=None, metadata={"help": "Where an inherited license was read."})
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
        for name in ("base_model", "base_model_id", "repo_id", "license", "license_name", "license_link", "pipeline_tag"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise ValueError(f"CardInfo.{name} must be a string, got {type(value).__name__}")
            if isinstance(value, os.PathLike):
                setattr(self, name, os.fspath(value))
        if self.base_model_id is not None and not looks_like_hub_id(self.base_model_id, check_disk=False):
            raise ValueError(f"CardInfo.base_model_id must be a Hub model id, got {self.base_model_id!r}")
        if self.base_model_id is None and self.base_model and not looks_like_hub_id(self.base_model):
            self.base_model_id = hub_cache_id(self.base_model)  # a Hub-cache snapshot folder names its Hub id
        if self.license is not None and not LICENSE_RE.match(self.license):
            raise ValueError(f"CardInfo.license must be a Hub license id such as 'apache-2.0', got {self.license!r}")
        if self.license is None:
            self.inherit_license(self.base_model)

    def inherit_license(self, base) -> None:
        """Take the base model's license (see `inherited_license`) unless one is set already."""
        found = None if self.license else inherited_license(base, self.base_model_id)
        if found:
            self.license, self.license_source = found["license"], found["source"]
            self.license_name = self.license_name or found["license_name"]
            self.license_link = self.license_link or found["license_link"]

    @classmethod
    def from_model(cls, model, **kwargs) -> "CardInfo":
        """Fill `model_type`, `architectures`, `growth_record` and `base_model` from a model; `kwargs` win.

        Also from where the model was loaded (`config._name_or_path`): `base_model_id` for a Hub-cache folder,
        and the base's license when none is given (`inherited_license`).

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
            "base_model_id": hub_cache_id(getattr(config, "_name_or_path", None)),  # loaded from the Hub cache: its id
        }
        found.update({k: v for k, v in kwargs.items() if v is not None or k not in found})
        info = cls(**found)
        # The base's license is read where the model was loaded from: `base_model` may be a public name by now.
        info.inherit_license(getattr(config, "_name_or_path", None) or None)
        return info


def as_card_info(info: "CardInfo | Mapping") -> CardInfo:
    """A `CardInfo` from itself or from a dict of its fields (unknown keys are an error naming them)."""
    if isinstance(info, CardInfo):
        return info
    if not isinstance(info, Mapping):
        raise TypeError(f"info must be a CardInfo or a dict, got {type(info).__name__}")
    known = {f.name for f in dataclasses.fields(CardInfo)}
    unknown = sorted(set(info) - known)
    if unknown:
        raise ValueError(f"unknown model-card fields {unknown}; known: {sorted(known)}")
    return CardInfo(**info)


def looks_like_hub_id(value, *, check_disk: bool = True) -> bool:
    """True for a syntactically valid Hub repo id that is not a local path or a file name."""
    if not isinstance(value, str) or not value or value.strip() != value:
        return False
    if value.startswith((".", "/", "~")) or "\\" in value or ":" in value:
        return False
    if PurePosixPath(value).suffix.lower() in FILE_SUFFIXES:
        return False
    if check_disk and os.path.exists(value):
        return False
    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def hub_cache_id(path) -> str | None:
    """The Hub id of a folder inside the Hub cache (`.../models--owner--name/snapshots/<rev>`), else `None`."""
    match = _HUB_CACHE_REPO.search(os.fspath(path)) if isinstance(path, (str, os.PathLike)) else None
    repo = f"{match.group(1)}/{match.group(2)}" if match else None
    return repo if repo and looks_like_hub_id(repo, check_disk=False) else None


def card_title(info: "CardInfo") -> str:
    """The card's title (and the model-index `name`): `title`, else the repo name, else "Depth-grown <base>"."""
    if info.title:
        return info.title
    if info.repo_id:
        return info.repo_id.split("/")[-1]
    base = info.base_model if info.base_model and looks_like_hub_id(info.base_model) else info.base_model_id
    name = base or (Path(info.base_model).name if info.base_model else None)
    return f"Depth-grown {name or 'model'}"


def is_file(value) -> bool:
    """A path to an existing file (Markdown text, with its newlines, never is)."""
    if isinstance(value, os.PathLike) or (isinstance(value, str) and "\n" not in value and len(value) < 4096):
        try:
            return Path(value).is_file()
        except OSError:
            return False
    return False


def hub_link(repo_id: str, kind: str = "") -> str:
    """A Markdown link to a Hub repository (`kind` is "datasets" for a data set)."""
    prefix = f"{kind}/" if kind else ""
    return f"[{repo_id}](https://huggingface.co/{prefix}{repo_id})"


def head_of(architectures) -> tuple[str | None, str]:
    """The Hub task (`pipeline_tag`) and Auto class of the first architecture with a known head."""
    for arch in architectures or []:
        for suffix, task, auto in HEADS:
            if arch.endswith(suffix):
                return task, auto
    return None, "AutoModel"


def _from_metadata(meta: dict | None, source: str, hub_id: str | None) -> dict | None:
    """`{"license", "license_name", "license_link", "source"}` from card metadata, or `None` without a valid license id."""
    license_id = (meta or {}).get("license")
    if not (isinstance(license_id, str) and LICENSE_RE.match(license_id)):
        return None
    found = {"license": license_id, "license_name": None, "license_link": None, "source": source}
    if license_id == "other":
        name, link = meta.get("license_name"), meta.get("license_link")
        if not (isinstance(name, str) and name):
            return None  # the Hub refuses `other` without a name: nothing usable to inherit
        found["license_name"] = name
        if isinstance(link, str) and "://" in link:
            found["license_link"] = link
        elif isinstance(link, str) and link and hub_id:  # relative: a file of the base's repository, not of this one
            found["license_link"] = f"https://huggingface.co/{hub_id}/blob/main/{link.removeprefix('./')}"
    return found


def _readme_metadata(path: Path) -> dict | None:
    from huggingface_hub.repocard import metadata_load

    try:
        return metadata_load(path)
    except Exception:  # noqa: BLE001 - an unreadable card is a card without a license
        return None


def _gguf_license(folder: Path) -> str | None:
    """`general.license` of the GGUF the embedded SmolLM2 cache folder was built from (`None` if not that folder)."""
    try:
        from ..data.models import COMPLETE_MARKER, SMOLLM2_GGUF_NAME, smollm2_gguf_path

        marker = folder / COMPLETE_MARKER
        if not marker.is_file() or json.loads(marker.read_text()).get("source") != SMOLLM2_GGUF_NAME:
            return None
        import gguf

        field = gguf.GGUFReader(str(smollm2_gguf_path())).fields.get("general.license")
        return bytes(field.parts[field.data[0]]).decode("utf-8") if field is not None else None
    except Exception:  # noqa: BLE001 - package or file missing: the license is unknown, not an error
        return None


def inherited_license(base: str | os.PathLike | None, hub_id: str | None = None) -> dict | None:
    """The license of the base model (`base`: a local folder or a Hub id; `hub_id`: the Hub id it is a copy of).

    Returns:
        `{"license", "license_name", "license_link", "source"}` (`source`: a phrase naming where it was read),
        or `None` when no source names a valid license id.

    Example:
        ```python
        >>> inherited_license(hf_depthgrow.data.models.minilm_path())["license"]
        'apache-2.0'
        >>> inherited_license("someone/model-not-in-the-local-cache") is None
        True
        ```
    """
    if base is not None and os.path.isdir(base):
        folder = Path(base)
        if (folder / "README.md").is_file():
            found = _from_metadata(_readme_metadata(folder / "README.md"), "the base model's card (README.md)", hub_id)
            if found:
                return found
        license_id = _gguf_license(folder)
        if license_id:
            return _from_metadata({"license": license_id}, "the base model's GGUF metadata (`general.license`)", hub_id)
    for repo in (hub_id, base):
        if isinstance(repo, str) and looks_like_hub_id(repo):
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(repo, "README.md")
            if isinstance(cached, str):
                found = _from_metadata(_readme_metadata(Path(cached)), f"the base model's Hub card ({hub_link(repo)}, from the local Hub cache)", repo)
                if found:
                    return found
    return None
