"""The license a grown model inherits: read from its base model's card or config, offline, never guessed.

A grown model is a derivative of its base model, so its card carries the base's license when the user
gives none. Where it is read, in order (the first that names a valid license id wins):

1. a local base folder's `README.md` metadata (`license`, with `license_name` / `license_link` for `other`);
2. the embedded SmolLM2 copy (`hf_depthgrow.load_model("smollm2")`): the `general.license` field of the GGUF
   file it was built from (its config; the cache folder has no card);
3. a Hub id: the base's `README.md` when the local Hub cache holds it (no network call is made).

Nothing found means no `license` in the metadata, and the card says the license is inherited but unknown.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .card_info import LICENSE_RE, hub_link, looks_like_hub_id

__all__ = ["inherited_license"]


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
