"""Where new blocks go: presets, plans and mergekit passthrough configs resolved to explicit entries.

`grow_depth` takes explicit positions, and also what LLaMA Pro, LLaMA-Factory and mergekit users
write: `"interleave:N"`, `"top:N"`, `"probe:N"`, a plan (`[{"at": k, "copy_from": j}, ...]` or
`{"plan": [...]}`), or a mergekit passthrough config that only duplicates layers.
`resolve_positions` turns any of them into `PlacementEntry`s before the model is touched, so a
bad spec is one `ValueError` and the model stays as it was.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from .checks import check_positions
from .config import INITS

PRESETS = ("interleave", "top", "probe")
_PRESET = re.compile(r"^\s*([A-Za-z_]+)\s*:\s*(.*?)\s*$")
_PLAN_KEYS = {"at", "copy_from", "init"}
# mergekit keys that do not change weights; anything else (models:, parameters:, ...) is refused.
_MERGEKIT_HARMLESS = {"slices", "merge_method", "dtype", "tokenizer_source", "tokenizer", "base_model", "name", "out_dtype"}
_SPECS = (
    "'interleave:N', 'top:N', 'probe:N', a list of positions, a plan (a list of {'at': k, 'copy_from': j}) "
    "or a YAML file holding one"
)


@dataclass(frozen=True)
class PlacementEntry:
    """One new block: where it goes and what it starts from.

    Args:
        at: Insertion point k (0..L): the block sees the residual stream entering original layer k.
        copy_from: Original layer j (0..L-1) a native block copies; `None`: the default rule (layer k-1, layer 0 for k = 0).
        init: `"copy"` or `"random"` for this block; `None`: the `GrowthConfig`'s.

    Example:
        ```python
        >>> PlacementEntry(at=4, copy_from=0).source
        0
        ```
    """

    at: int
    copy_from: int | None = None
    init: str | None = None

    @property
    def source(self) -> int:
        """The original layer a native block is built from (copied, or whose class and attributes it takes)."""
        return self.copy_from if self.copy_from is not None else max(self.at - 1, 0)

    @property
    def is_default(self) -> bool:
        """True where the block is what an explicit position builds (no copy source or init of its own)."""
        return self.copy_from is None and self.init is None


def resolve_positions(spec, num_layers: int, *, probe_result=None, model=None) -> list[PlacementEntry]:
    """Any placement spec as explicit entries, sorted by position (stable: a plan's order within a position is kept).

    Presets, for a model of L layers and N new blocks (1 <= N <= L, at most doubling the depth):
    - `"interleave:N"`: block j (0..N-1) at position `floor((j+1)*L/N + 1/2)`, i.e. after original
      layer `round((j+1)*L/N) - 1` rounding halves up. Distinct, evenly spread, the last at L; for L
      divisible by N it is LLaMA Pro's block after every L/N layers. No divisibility needed.
    - `"top:N"`: N blocks at position L (after the last layer).
    - `"probe:N"`: the N positions with the largest probe z-scores (needs `probe_result=`).

    A plan is a list of `{"at": k, "copy_from": j, "init": "copy"|"random"}` (only `at` required) or a
    dict `{"plan": [...]}`; a mergekit passthrough config (`slices:` of one model) is read as the plan
    that yields the same layer order. A string ending in `.yaml`/`.yml`/`.json` is read as a file.
    Its `model:` must be `model` (the one being grown; see `check_plan_model`): the copies are of its layers.

    Raises:
        ValueError: naming what is wrong with the spec.

    Example:
        ```python
        >>> [e.at for e in resolve_positions("interleave:8", 30)]
        [4, 8, 11, 15, 19, 23, 26, 30]
        >>> resolve_positions([{"at": 4, "copy_from": 0}], 4)
        [PlacementEntry(at=4, copy_from=0, init=None)]
        ```
    """
    if isinstance(spec, (str, Path)) and str(spec).lower().endswith((".yaml", ".yml", ".json")):
        spec = load_plan(spec)
    if isinstance(spec, str) and (":" in spec or not spec.strip().lstrip("+-").isdigit()):
        return _preset(spec, num_layers, probe_result)
    if isinstance(spec, dict):
        if "plan" in spec:
            extra = sorted(set(spec) - {"plan"})
            if extra:
                raise ValueError(f"a plan dict holds only the key 'plan', got also {extra}")
            return _plan(spec["plan"], num_layers)
        if "slices" in spec or "models" in spec or "merge_method" in spec:
            return _mergekit(spec, num_layers, model)
        raise ValueError(f"a placement dict needs the key 'plan' or mergekit 'slices', got keys {sorted(spec)}")
    if isinstance(spec, (list, tuple)) and any(isinstance(item, dict) for item in spec):
        return _plan(spec, num_layers)
    # Explicit positions: exactly the checks (and messages) grow_depth always had.
    return [PlacementEntry(at=k) for k in check_positions(spec, num_layers)]


def load_plan(path) -> object:
    """The plan or mergekit config in a YAML (or JSON) file.

    Example:
        ```python
        >>> load_plan("plan.yaml")
        {'plan': [{'at': 8, 'copy_from': 2}]}
        ```
    """
    from ..utils import kind_of, read_structured

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no such plan file: {path}")
    expected = "a list of objects ({'at': k, ...}) or of positions, or a mapping with 'plan' or mergekit 'slices'"
    data = read_structured(path, expected=expected, label="plan file")
    if (isinstance(data, dict) and ("plan" in data or "slices" in data)) or (isinstance(data, list) and data and (
            all(isinstance(item, dict) for item in data) or all(isinstance(item, int) and not isinstance(item, bool) for item in data))):
        return data
    if isinstance(data, list) and data:
        objects = any(isinstance(item, dict) for item in data)  # a plan: every entry an object; else positions: every one an int
        wrong = next(i for i, item in enumerate(data) if (not isinstance(item, dict) if objects else not isinstance(item, int) or isinstance(item, bool)))
        got = f"but entry {wrong} is {kind_of(data[wrong])}"
    elif isinstance(data, dict):
        got = f"got a mapping with keys {sorted(map(str, data))}"
    else:
        got = "got " + ("an empty list" if isinstance(data, list) else kind_of(data))
    raise ValueError(f"plan file {path}: expected {expected}, {got}")


def check_placement(spec: str) -> object:
    """Check a placement string's form before any model loads (its range needs the depth); a file is read.

    Returns what `resolve_positions` should be given: the string, or the file's contents.

    Example:
        ```python
        >>> check_placement("interleave:8")
        'interleave:8'
        ```
    """
    if str(spec).lower().endswith((".yaml", ".yml", ".json")):
        return load_plan(spec)
    match = _PRESET.match(spec)
    if not match or match.group(1).lower() not in PRESETS:
        raise ValueError(f"unknown placement {spec!r}: use {_SPECS}.")
    if not re.fullmatch(r"[+-]?\d+", match.group(2)) or int(match.group(2)) < 1:
        raise ValueError(f"placement {spec!r}: N must be an integer >= 1, got {match.group(2)!r}")
    return spec


def describe(spec) -> object:
    """The spec as plain JSON data, for the growth record (a file is stored by its contents).

    A mergekit config's local paths (`model: /home/me/models/llama`) are stored as the folder's name: the
    record goes into config.json and so into every pushed copy, where a path says nothing but the machine's layout.
    """
    if isinstance(spec, (str, Path)) and str(spec).lower().endswith((".yaml", ".yml", ".json")):
        spec = load_plan(spec)
    plain = json.loads(json.dumps(spec if isinstance(spec, (str, dict, list, tuple)) else list(spec)))
    return _without_local_paths(plain) if isinstance(plain, dict) and "slices" in plain else plain


def _is_local_path(text: str) -> bool:
    if text.startswith(("/", "./", "../", "~")) or Path(text).is_absolute():
        return True
    return "/" in text.strip("/") and Path(text).expanduser().exists()  # a relative folder "models/llama"


def _without_local_paths(value):
    if isinstance(value, dict):
        return {k: _without_local_paths(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_local_paths(v) for v in value]
    if isinstance(value, str) and _is_local_path(value):
        return Path(value.rstrip("/")).expanduser().name or value
    return value


# Config keys that fix the shape of every layer: equal in two configs, a plan's layer ranges mean the same layers.
_IDENTITY_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "vocab_size")


def _last_name(name: str) -> str:
    # Hub id "org/name", a Hub-cache snapshot ".../models--org--name/snapshots/<rev>", or a folder: its name.
    cached = re.search(r"models--[^/]+--([^/]+)/snapshots/", name)
    return (cached.group(1) if cached else Path(name.rstrip("/")).name).lower()


def _same_embedding(folder: Path, model) -> bool:
    """Whether `folder`'s safetensors hold `model`'s input embedding (one tensor read; `True` where none can be
    read: the config alone then decides). Two fine-tunes of one base share a config, never their embeddings."""
    from safetensors import safe_open

    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(emb, "weight", None)
    name = next((n for n, p in model.named_parameters() if p is weight), None)
    files = sorted(folder.glob("*.safetensors"))
    if weight is None or name is None or not files:
        return True
    suffix = name.split(".", 1)[-1]  # "embed_tokens.weight" of "model.embed_tokens.weight": saved keys may differ in prefix
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            key = next((k for k in f.keys() if k == name or k.endswith("." + suffix) or k == suffix), None)
            if key is not None:
                theirs = f.get_tensor(key)
                return theirs.shape == weight.shape and bool((theirs.float() == weight.detach().float().cpu()).all())
    return True


def check_plan_model(named, model) -> None:
    """Refuse a mergekit plan whose `model:` is not `model`: every copy is of `model`'s own layers, so a plan
    written for another model would silently copy the wrong ones.

    The same model is: the same name or folder (`samefile`), the same last name (a Hub id `org/Name` and a local
    `.../name` or Hub-cache folder of it, case-insensitively), or a local folder whose `config.json` agrees with
    `model`'s on every shape key (`_IDENTITY_KEYS`) and whose saved input embedding is `model`'s (a copy saved
    under another name). A model built in memory has no name; it is then checked against a local folder only.
    """
    if named is None:
        return
    if not isinstance(named, str) or not named.strip():
        raise ValueError(f"mergekit config: model must be a model name or folder, got {named!r}")
    own = str(getattr(model.config, "_name_or_path", "") or "")
    folder = Path(named).expanduser()
    if own and (named.rstrip("/") == own.rstrip("/") or _last_name(named) == _last_name(own)):
        return
    if own and folder.exists() and Path(own).expanduser().exists() and folder.samefile(Path(own).expanduser()):
        return
    if (folder / "config.json").is_file():
        theirs = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        if all(theirs.get(k) == getattr(model.config, k, None) for k in _IDENTITY_KEYS) and _same_embedding(folder, model):
            return
    elif not own:
        return  # an unnamed in-memory model and a Hub id: nothing to compare without downloading
    raise ValueError(
        f"this mergekit config copies layers of {named!r}, but the model being grown is "
        f"{own or 'an unnamed ' + type(model).__name__!r}: a passthrough plan is grown from the model's own "
        "layers, so it must name that model (its Hub id or folder)."
    )


def _count(name: str, text: str, num_layers: int) -> int:
    if not re.fullmatch(r"[+-]?\d+", text):
        raise ValueError(f"placement '{name}:{text}': N must be an integer, got {text!r}")
    n = int(text)
    if not 1 <= n <= num_layers:
        raise ValueError(
            f"placement '{name}:{n}': N must be in 1..{num_layers} (at most one new block per original layer, "
            f"doubling the depth of this {num_layers}-layer model); grow again for more."
        )
    return n


def _preset(spec: str, num_layers: int, probe_result) -> list[PlacementEntry]:
    match = _PRESET.match(spec)
    name = match.group(1).lower() if match else ""
    if name not in PRESETS:
        raise ValueError(f"unknown placement {spec!r}: use {_SPECS}.")
    n = _count(name, match.group(2), num_layers)
    if name == "interleave":
        # Integer arithmetic: floor((j+1)*L/N + 1/2) without float rounding (or Python's round-half-even).
        positions = [(2 * (j + 1) * num_layers + n) // (2 * n) for j in range(n)]
    elif name == "top":
        positions = [num_layers] * n
    else:
        positions = _probe_top(probe_result, n, num_layers)
    return [PlacementEntry(at=k) for k in sorted(positions)]


def _probe_top(result, n: int, num_layers: int) -> list[int]:
    if result is None:
        raise ValueError(
            f"placement 'probe:{n}' needs the probe's result: pass probe_result=probe(model, data) to grow_depth "
            "(grow_depth does not run the probe itself)."
        )
    if getattr(result, "num_layers", num_layers) != num_layers:
        raise ValueError(f"probe_result was measured on {result.num_layers} layers, but the model has {num_layers}: probe it again.")
    # NaN z-scores (positions the probe could not measure) rank last; ties keep the lower position.
    ranked = [k for z, k in sorted(((z, k) for k, z in zip(result.positions, result.z) if z == z), key=lambda t: (-t[0], t[1]))]
    if len(ranked) < n:
        raise ValueError(f"placement 'probe:{n}': the probe has z-scores at only {len(ranked)} positions.")
    return ranked[:n]


def _int_field(entry: dict, key: str, low: int, high: int, i: int) -> int:
    value = entry[key]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"plan entry {i}: {key} must be an int in {low}..{high} for this {high if key == 'at' else high + 1}-layer model, got {value!r}")
    return value


def _plan(plan, num_layers: int) -> list[PlacementEntry]:
    if not isinstance(plan, (list, tuple)) or not plan:
        raise ValueError(f"a plan must be a non-empty list of {{'at': k, 'copy_from': j}} entries, got {plan!r}")
    entries = []
    for i, entry in enumerate(plan):
        if not isinstance(entry, dict) or "at" not in entry:
            raise ValueError(f"plan entry {i} must be a dict with at least 'at', got {entry!r}")
        unknown = sorted(set(entry) - _PLAN_KEYS)
        if unknown:
            raise ValueError(f"plan entry {i}: unknown keys {unknown}; an entry holds {sorted(_PLAN_KEYS)}")
        at = _int_field(entry, "at", 0, num_layers, i)
        source = None if entry.get("copy_from") is None else _int_field(entry, "copy_from", 0, num_layers - 1, i)
        init = entry.get("init")
        if init is not None and (not isinstance(init, str) or init not in INITS):
            raise ValueError(f"plan entry {i}: init must be one of {INITS}, got {init!r}")
        entries.append(PlacementEntry(at=at, copy_from=source, init=init))
    return sorted(entries, key=lambda e: e.at)


def _mergekit(config: dict, num_layers: int, model=None) -> list[PlacementEntry]:
    method = config.get("merge_method", "passthrough")
    if method != "passthrough" or "models" in config:
        raise ValueError(
            f"this mergekit config merges weights (merge_method {method!r}{', models:' if 'models' in config else ''}): "
            "only a passthrough config that duplicates layers of one model can be grown exactly."
        )
    unknown = sorted(set(config) - _MERGEKIT_HARMLESS)
    if unknown:
        raise ValueError(f"mergekit config: unsupported keys {unknown}; only passthrough 'slices' of one model are read")
    layers, models = [], set()
    for i, piece in enumerate(config.get("slices") or ()):
        sources = piece.get("sources") if isinstance(piece, dict) else None
        if not isinstance(sources, list) or len(sources) != 1 or not isinstance(sources[0], dict):
            raise ValueError(f"mergekit slice {i} must have exactly one source (several sources merge weights), got {piece!r}")
        source = sources[0]
        if set(source) - {"model", "layer_range"}:
            raise ValueError(f"mergekit slice {i}: source keys {sorted(set(source) - {'model', 'layer_range'})} change weights; only model and layer_range are read")
        models.add(source.get("model"))
        span = source.get("layer_range")
        if not (isinstance(span, list) and len(span) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in span)
                and 0 <= span[0] < span[1] <= num_layers):
            raise ValueError(f"mergekit slice {i}: layer_range must be [a, b] with 0 <= a < b <= {num_layers}, got {span!r}")
        layers.extend(range(*span))
    if len(models) > 1:
        raise ValueError(f"this mergekit config uses several models ({sorted(map(str, models))}): only layers of the model being grown can be copied")
    if not layers:
        raise ValueError("mergekit config has no slices: nothing to grow")
    (named,) = models
    if model is not None:
        check_plan_model(named, model)
    return _copies_of(layers, num_layers)


def _copies_of(layers: list[int], num_layers: int) -> list[PlacementEntry]:
    # Greedy: the first occurrence that continues 0, 1, 2, ... is the original layer; every other
    # layer is a copy inserted where it stands, i.e. before the next original layer still to come.
    entries, nxt = [], 0
    for j in layers:
        if j == nxt:
            nxt += 1
        else:
            entries.append(PlacementEntry(at=nxt, copy_from=j))
    if nxt != num_layers:
        raise ValueError(
            f"mergekit config drops or reorders original layers (layer {nxt} is missing after the layers before it): "
            "only configs that keep every layer in order and duplicate some can be grown exactly."
        )
    if not entries:
        raise ValueError("mergekit config duplicates no layer: nothing to grow")
    return entries
