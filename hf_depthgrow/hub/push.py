"""Push a grown model, its card and its evaluation report to the Hugging Face Hub.

Everything goes through huggingface_hub's `HfApi` (`create_repo(exist_ok=True)`, then
`upload_folder`), so the token, the endpoint (`HF_ENDPOINT`), Xet and LFS behave as for any
other Hub upload. What this module adds are the checks that make a wrong push hard:

- no push without an explicit repo id (checked before any network call);
- only a folder that looks like a saved model (`config.json`, or the adapter file of an
  adapters-only save) with safetensors weights, and no pickle anywhere in it;
- a README.md whose metadata the Hub would reject is refused offline;
- no local absolute path is uploaded: metadata files that name one (a growth record's plan source,
  an adapters-only save's base) go up with each path replaced by its public name (`public_copies`),
  and an adapters-only folder whose base is a local folder without a Hub id is refused;
- an unreachable Hub (or `HF_HUB_OFFLINE=1`) gives one clear error naming the endpoint and how
  to point at another.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path, PurePosixPath
from typing import Mapping

from huggingface_hub import CommitOperationAdd, HfApi, ModelCard, constants, get_token
from huggingface_hub.errors import HFValidationError, OfflineModeIsEnabled
from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects, validate_repo_id

from ..evaluation.formatting import ABS_PATH, scrub_paths
from .card_info import CardInfo, as_card_info, hub_cache_id, is_file, looks_like_hub_id
from .card_metadata import validate_card_metadata
from .model_card import render_model_card
from .serialization import ADAPTER_CONFIG, save_pretrained

# Pickle-based formats: loading them runs arbitrary code, so grown models travel as safetensors only.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
MODEL_MARKERS = ("config.json", ADAPTER_CONFIG)
DEFAULT_COMMIT_MESSAGE = "Upload depth-grown model with hf_depthgrow"
_PUSH_KWARGS = {"token", "private", "endpoint", "revision", "commit_message", "create_pr"}
# What people and loaders read on another machine, where a local path means nothing and tells the world this
# one's layout. Tokenizer vocabularies are data (a token may look like a path) and are never rewritten.
PUBLIC_TEXT_SUFFIXES = (".json", ".md", ".yaml", ".yml")
_VOCABULARIES = {"tokenizer.json", "vocab.json"}


class HubUnreachableError(ConnectionError):
    """The Hub endpoint could not be reached (no network, wrong endpoint, or offline mode)."""


def _network_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [OfflineModeIsEnabled, ConnectionError]
    try:  # the HTTP client huggingface_hub uses; only its transport errors mean "unreachable"
        import httpx2

        errors.append(httpx2.TransportError)
    except ImportError:  # pragma: no cover - older huggingface_hub clients
        try:
            import httpx

            errors.append(httpx.TransportError)
        except ImportError:
            pass
    return tuple(errors)


def check_repo_id(repo_id) -> str:
    """Return `repo_id` if it names a Hub repository, else raise `ValueError` saying why.

    Example:
        ```python
        >>> check_repo_id("me/grown-smollm2")
        'me/grown-smollm2'
        ```
    """
    if repo_id is None:
        raise ValueError("repo_id is required: pass the Hub repository to push to, e.g. 'your-name/grown-model'")
    if not isinstance(repo_id, str):
        raise ValueError(f"repo_id must be a string such as 'your-name/grown-model', got {type(repo_id).__name__}")
    if not repo_id.strip():
        raise ValueError(f"repo_id is empty ({repo_id!r}): pass the Hub repository to push to, e.g. 'your-name/grown-model'")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ValueError(f"repo_id {repo_id!r} is not a valid Hub repository id ('namespace/name'): {err}") from err
    if repo_id.count("/") != 1:  # a bare name would land in whichever account the token belongs to
        raise ValueError(f"repo_id {repo_id!r} has no namespace: pass 'namespace/name', e.g. 'your-name/{repo_id}'")
    return repo_id


def _endpoint(endpoint: str | None) -> str:
    return (endpoint or constants.ENDPOINT).rstrip("/")


def check_model_folder(folder: str | os.PathLike) -> Path:
    """Refuse a folder that is not a saved model or that holds pickle files; return it as a `Path`.

    A saved model has `config.json` (or `depthgrow_adapters.json` for an adapters-only save) and
    `.safetensors` weights. Files ending in `.bin`, `.pt`, `.pth`, `.pkl`, `.pickle` or `.ckpt` are
    refused anywhere in the folder (`.git/` aside, which is never uploaded).

    Example:
        ```python
        >>> save_pretrained(model, "grown")
        >>> check_model_folder("grown")
        PosixPath('grown')
        ```
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder: save the model first (hf_depthgrow.save_pretrained)")
    files = [p for p in folder.rglob("*") if p.is_file() and ".git" not in p.relative_to(folder).parts]
    pickles = sorted(p.relative_to(folder).as_posix() for p in files if p.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        raise ValueError(
            f"{folder} holds pickle files {pickles}: only safetensors are pushed (a pickle runs code when loaded). "
            "Save with hf_depthgrow.save_pretrained (safetensors) and remove them."
        )
    if not any((folder / marker).is_file() for marker in MODEL_MARKERS):
        raise ValueError(
            f"{folder} does not look like a saved model: no config.json (or {ADAPTER_CONFIG} for an adapters-only save). "
            "Save it with hf_depthgrow.save_pretrained first."
        )
    if not any(p.suffix == ".safetensors" for p in files):
        raise ValueError(f"{folder} has no .safetensors weights: save the model with hf_depthgrow.save_pretrained first")
    return folder


def _check_readme(readme: Path) -> None:
    """The Hub rejects the whole commit on bad metadata: say so before uploading anything."""
    if readme.is_file():
        try:
            validate_card_metadata(readme.read_text(encoding="utf-8"))
        except ValueError as err:
            raise ValueError(f"{readme}: {err}") from err


def _scrub_json(value, key: str = ""):
    """JSON data with local paths in its strings replaced; a template (Jinja text) is code and stays as it is."""
    if isinstance(value, str):
        return value if "template" in key else scrub_paths(value)
    if isinstance(value, dict):
        return {k: _scrub_json(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub_json(v, key) for v in value]
    return value


def _adapter_base(base):
    """An adapters-only save is loaded onto `base_model`: on the Hub that must be a Hub id, not a local folder."""
    if not isinstance(base, str) or looks_like_hub_id(base, check_disk=False):
        return base
    hub_id = hub_cache_id(base)  # a folder of the Hub cache names its Hub id
    if hub_id is None:
        raise ValueError(
            f"{ADAPTER_CONFIG} names the local base model {scrub_paths(base)!r}, which nobody who downloads the adapters can "
            "load: save (or push) with base_model='<the Hub id of the base weights>'"
        )
    return hub_id


def _public_json(rel: str, text: str) -> bytes | None:
    """A JSON file's public copy (`None`: it needs none); `json.JSONDecodeError` if it is not JSON."""
    data = json.loads(text)
    public = _scrub_json(data)
    if rel == ADAPTER_CONFIG and isinstance(data, dict) and "base_model" in data:
        public["base_model"] = _adapter_base(data["base_model"])
    return None if public == data else (json.dumps(public, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def _public_text(text: str) -> bytes | None:
    return None if scrub_paths(text) == text else scrub_paths(text).encode("utf-8")


def _upload_files(folder: Path) -> list[str]:
    """The files `upload_folder` would upload (its default ignore patterns: `.git/`, `.cache/huggingface/`)."""
    names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    return list(filter_repo_objects(names, ignore_patterns=DEFAULT_IGNORE_PATTERNS))


def public_copies(folder: str | os.PathLike) -> dict[str, bytes]:
    """`{path in repo: content}` for each metadata file of `folder` that names a local absolute path, that path replaced.

    Metadata files are the `.json`, `.md`, `.yaml` files (tokenizer vocabularies aside). Each local path
    becomes its public name (`evaluation.formatting.public_name`: a Hub-cache folder's Hub id, else the
    folder or file name); a JSON file is rewritten from its parsed data (indent 2, key order kept). Files
    without a local path are not listed: they are uploaded byte for byte. The files on disk never change.

    Raises:
        `ValueError`: an adapters-only save whose `base_model` is a local folder with no Hub id.
    """
    folder = Path(folder)
    out = {}
    for rel in _upload_files(folder):
        if not rel.endswith(PUBLIC_TEXT_SUFFIXES) or PurePosixPath(rel).name in _VOCABULARIES:
            continue
        text = (folder / rel).read_text(encoding="utf-8", errors="replace")
        if not ABS_PATH.search(text) and rel != ADAPTER_CONFIG:
            continue
        try:
            public = _public_json(rel, text) if rel.endswith(".json") else _public_text(text)
        except json.JSONDecodeError:  # not JSON after all
            public = _public_text(text)
        if public is not None:
            out[rel] = public
    return out


def _check_can_push(endpoint, token, *, create_pr=False, revision=None) -> str:
    """The endpoint a push goes to, once the push could start: online, a token, a revision that fits `create_pr`."""
    if create_pr and revision not in (None, constants.DEFAULT_REVISION):
        raise ValueError(f"create_pr=True opens the pull request against the default branch; do not pass revision={revision!r}")
    hub = _endpoint(endpoint)
    if constants.is_offline_mode():
        raise HubUnreachableError(
            f"cannot push to {hub}: huggingface_hub's offline mode is on (HF_HUB_OFFLINE=1). "
            "Unset HF_HUB_OFFLINE (or set it to 0) in the shell that runs the push."
        )
    if token is None and get_token() is None:
        raise ValueError(
            "no Hugging Face token: pass token=..., set the HF_TOKEN environment variable, or run `hf auth login`"
        )
    return hub


def push_to_hub(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    token: str | bool | None = None,
    private: bool | None = None,
    endpoint: str | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    create_pr: bool = False,
) -> str:
    """Upload a saved grown model (a folder) to a Hub model repository, creating it if needed.

    Args:
        folder: A folder written by `hf_depthgrow.save_pretrained`, possibly with README.md and
            report files beside the weights; uploaded as it is, except that metadata files naming a
            local absolute path go up with that path replaced (`public_copies`; a warning says which).
        repo_id: The repository, `"namespace/name"`. Required: nothing is pushed without it.
        token: A Hub token; default: huggingface_hub's own resolution (`HF_TOKEN`, then the token
            stored by `hf auth login`). `False` pushes without one (e.g. to a local test Hub).
        private: Create the repository private (ignored if it exists already).
        endpoint: The Hub to push to; default `HF_ENDPOINT` or https://huggingface.co.
        revision: Branch to push to (created from the default branch if missing); default `main`.
        commit_message: Default: "Upload depth-grown model with hf_depthgrow".
        create_pr: Open a pull request instead of committing to the branch.

    Returns:
        `str`: The URL of the commit.

    Raises:
        `ValueError`: no or invalid `repo_id`, a folder that is not a saved model, pickle files,
            invalid README.md metadata, an adapters-only save whose base is a local folder, no token.
        `HubUnreachableError`: the endpoint cannot be reached or offline mode is on.

    Example:
        ```python
        >>> from hf_depthgrow import save_pretrained
        >>> from hf_depthgrow.hub.push import push_to_hub
        >>> save_pretrained(model, "grown", tokenizer=tokenizer)
        >>> push_to_hub("grown", "your-name/grown-smollm2", private=True)
        'https://huggingface.co/your-name/grown-smollm2/commit/...'
        ```
    """
    repo_id = check_repo_id(repo_id)
    folder = check_model_folder(folder)
    _check_can_push(endpoint, token, create_pr=create_pr, revision=revision)
    _check_readme(folder / "README.md")
    public = public_copies(folder)
    if public:
        warnings.warn(
            f"push_to_hub: {', '.join(sorted(public))} of {folder} name local paths; uploaded with each path replaced by "
            "its folder or file name (the files on disk are unchanged)",
            stacklevel=2,
        )
    hub = _check_can_push(endpoint, token, create_pr=create_pr, revision=revision)
    from ..utils import __version__

    api = HfApi(endpoint=hub, token=token, library_name="hf_depthgrow", library_version=__version__)
    try:
        api.create_repo(repo_id, private=private, repo_type="model", exist_ok=True)
        if revision not in (None, constants.DEFAULT_REVISION):
            api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
        info = _upload(api, folder, repo_id, public, revision=revision, commit_message=commit_message or DEFAULT_COMMIT_MESSAGE,
                       create_pr=create_pr or None)
    except _network_errors() as err:
        raise HubUnreachableError(
            f"the Hugging Face Hub at {hub} is unreachable ({type(err).__name__}: {err}). Check the network, or push to "
            "another Hub with push_to_hub(..., endpoint='https://your-hub') or the HF_ENDPOINT environment variable "
            "(set before Python starts)."
        ) from err
    return str(info.commit_url)


def _upload(api: HfApi, folder: Path, repo_id: str, public: dict[str, bytes], **commit):
    """`upload_folder` when every file goes up as it is; else one commit with the public copies in place of the originals."""
    if not public:
        return api.upload_folder(repo_id=repo_id, folder_path=folder, repo_type="model", **commit)
    operations = [CommitOperationAdd(path_in_repo=rel, path_or_fileobj=public.get(rel, str(folder / rel))) for rel in _upload_files(folder)]
    return api.create_commit(repo_id=repo_id, operations=operations, repo_type="model", **commit)


def _extra_files(extra_files) -> dict[str, Path]:
    if not extra_files:
        return {}
    if not isinstance(extra_files, Mapping):  # a list of paths: keep their file names
        extra_files = {Path(p).name: p for p in extra_files}
    out = {}
    for name, src in extra_files.items():
        parts = PurePosixPath(str(name)).parts
        if not parts or PurePosixPath(str(name)).is_absolute() or ".." in parts or "\\" in str(name):
            raise ValueError(f"extra_files: {name!r} must be a relative path inside the repository")
        src = Path(src)
        if not src.is_file():
            raise ValueError(f"extra_files: {src} (for {name!r}) is not a file")
        out[PurePosixPath(str(name)).as_posix()] = src
    return out


def _model_card(model, card, *, repo_id: str, adapters_only: bool, base_model) -> ModelCard | None:
    if card is False:
        return None
    if card is None:
        card = CardInfo.from_model(model, repo_id=repo_id, adapters_only=adapters_only, base_model=base_model)
    if isinstance(card, ModelCard):
        return card
    if isinstance(card, (str, os.PathLike)):
        return ModelCard(Path(card).read_text(encoding="utf-8") if is_file(card) else str(card))
    if isinstance(card, Mapping):
        card = as_card_info(card)
    if isinstance(card, CardInfo):
        # What the model itself knows fills what the caller left out, so metadata matches the pushed files.
        merged = vars(CardInfo.from_model(model, repo_id=repo_id, adapters_only=adapters_only, base_model=base_model))
        merged.update({k: v for k, v in vars(card).items() if v is not None})
        merged["adapters_only"] = adapters_only
        return render_model_card(CardInfo(**merged))
    raise TypeError(f"card must be a ModelCard, CardInfo, dict, Markdown text, a path, None or False; got {type(card).__name__}")


def push_model_to_hub(
    model,
    repo_id: str,
    *,
    tokenizer=None,
    card=None,
    extra_files: Mapping[str, str | os.PathLike] | None = None,
    adapters_only: bool = False,
    base_model: str | None = None,
    **push_kwargs,
) -> str:
    """Save a grown model (safetensors) with its card and report files into a temporary folder and push it.

    Args:
        model: A model grown by `grow_depth` (trained or not).
        repo_id: The repository, `"namespace/name"`. Required.
        tokenizer: Saved beside the model when given.
        card: The README.md: a `ModelCard`, a `CardInfo` or dict for `render_model_card` (fields
            the model knows, such as the growth record, are filled in), Markdown text, or a path.
            `None` renders a card from the model alone; `False` pushes no README.md.
        extra_files: `{path in repo: local file}` (or a list of local files, kept under their names),
            e.g. `report.json`, `report.md` and the plots; they must not replace a saved file.
        adapters_only: Push only the adapter blocks and the growth record (see `save_pretrained`).
        base_model: Hub id (or path) of the base weights; required with `adapters_only=True`, and
            the card's `base_model`.
        **push_kwargs: `token`, `private`, `endpoint`, `revision`, `commit_message`, `create_pr`
            (see `push_to_hub`).

    Returns:
        `str`: The URL of the commit.

    Example:
        ```python
        >>> from hf_depthgrow import grow_depth
        >>> from hf_depthgrow.hub.push import push_model_to_hub
        >>> grow_depth(model, [15])
        >>> push_model_to_hub(model, "your-name/grown-smollm2", tokenizer=tokenizer,
        ...                   card={"evaluation": eval_result, "config": run_config, "license": "apache-2.0"},
        ...                   extra_files={"report.json": "out/report.json", "report.md": "out/report.md"},
        ...                   base_model="HuggingFaceTB/SmolLM2-135M")
        ```
    """
    repo_id = check_repo_id(repo_id)  # before the (possibly long) save
    unknown = sorted(set(push_kwargs) - _PUSH_KWARGS)
    if unknown:
        raise TypeError(f"push_model_to_hub got unexpected arguments {unknown}; push options are {sorted(_PUSH_KWARGS)}")
    # Offline, no token or a bad revision: said before the model is written (a save can take minutes and gigabytes).
    _check_can_push(push_kwargs.get("endpoint"), push_kwargs.get("token"), create_pr=push_kwargs.get("create_pr", False),
                    revision=push_kwargs.get("revision"))
    extra = _extra_files(extra_files)
    readme = _model_card(model, card, repo_id=repo_id, adapters_only=adapters_only, base_model=base_model)
    with tempfile.TemporaryDirectory(prefix="hf_depthgrow-push-") as tmp:
        folder = save_pretrained(model, Path(tmp) / "model", tokenizer=tokenizer, adapters_only=adapters_only, base_model=base_model)
        if readme is not None:
            readme.save(folder / "README.md")
        for name, public in public_copies(folder).items():  # this save is ours to make public (push_to_hub would warn)
            (folder / name).write_bytes(public)
        for name, src in extra.items():
            dest = folder / name
            if dest.exists():
                raise ValueError(f"extra_files: {name!r} would replace a file of the saved model")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dest)
        return push_to_hub(folder, repo_id, **push_kwargs)
