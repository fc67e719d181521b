"""What a GGUF file is called and holds: llama.cpp's tensor names for a model, and a fast reader of a file's header.

`gguf_export` writes with these; they also serve any reader of a GGUF (the source file's types, the tests). The
names come from the `gguf` package's own table for the architecture, the one llama.cpp's converter uses.

Example:
    ```python
    >>> dict(tensor_names(tiny_model("llama")))["blk.0.attn_q.weight"]
    'model.layers.0.self_attn.q_proj.weight'
    >>> read_gguf_header(smollm2_gguf_path()).value("llama.block_count")
    30
    ```
"""

from __future__ import annotations

import mmap
import os
import struct
from collections import Counter
from dataclasses import dataclass

import gguf

__all__ = ["ARCHITECTURES", "ARRAY", "FAMILIES", "STRING", "GGUFFamily", "GGUFHeader", "read_gguf_header", "source_types", "tensor_names"]


@dataclass(frozen=True)
class GGUFFamily:
    """How llama.cpp's converter (`convert_hf_to_gguf.py`) writes one transformers family.

    `arch`: the llama.cpp architecture (the `gguf.MODEL_ARCH_NAMES` value whose tensor-name map is used);
    `permute_qk`: Q/K rows reordered for GGML's interleaved rope (`LlamaModel.permute`);
    `norm_offset`: added to every RMSNorm weight (Gemma computes `x * (1 + w)`, llama.cpp `x * w`);
    `activation`: the MLP activation the llama.cpp graph hard-codes.
    """

    arch: str
    permute_qk: bool = False
    norm_offset: float = 0.0
    activation: str = "silu"


# transformers model_type -> how llama.cpp writes it. Only families whose GGUF round trip is tested are listed.
# Mistral is written as "llama" (convert_hf_to_gguf.py registers MistralForCausalLM under LlamaModel).
FAMILIES = {
    "llama": GGUFFamily("llama", permute_qk=True),
    "mistral": GGUFFamily("llama", permute_qk=True),
    "qwen2": GGUFFamily("qwen2"),  # q/k/v biases: llama.cpp's qwen2 graph reads them
    "gemma2": GGUFFamily("gemma2", norm_offset=1.0, activation="gelu_pytorch_tanh"),
    # Gemma-3's text model: q/k norms (stored as 1 + w like every Gemma norm), two rope bases, a fixed window period
    "gemma3_text": GGUFFamily("gemma3", norm_offset=1.0, activation="gelu_pytorch_tanh"),
}
ARCHITECTURES = {model_type: family.arch for model_type, family in FAMILIES.items()}
# GGUF value types (`gguf.GGUFValueType`), as plain ints: the header is parsed with `struct`, not numpy.
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFHeader:
    """`metadata[key] = (value, value type, array item type or None)`, `tensors[name] = (ggml type, torch shape)`."""

    metadata: dict
    tensors: dict

    def value(self, key: str, default=None):
        return self.metadata[key][0] if key in self.metadata else default


def _read_string(buf, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, pos)
    return bytes(buf[pos + 8 : pos + 8 + length]).decode("utf-8"), pos + 8 + length


def _read_value(buf, pos: int, vtype: int):
    if vtype in _SCALAR:
        return struct.unpack_from(_SCALAR[vtype], buf, pos)[0], pos + struct.calcsize(_SCALAR[vtype])
    if vtype == STRING:
        return _read_string(buf, pos)
    if vtype != ARRAY:
        raise ValueError(f"unknown GGUF value type {vtype}")
    item, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if item in _SCALAR:  # one unpack for the whole array: a 49k-entry token_type array in microseconds
        fmt = _SCALAR[item]
        return list(struct.unpack_from(f"<{count}{fmt[1]}", buf, pos)), pos + count * struct.calcsize(fmt)
    values = [None] * count
    for i in range(count):
        values[i], pos = _read_value(buf, pos, item)
    return values, pos


def read_gguf_header(path: str | os.PathLike) -> GGUFHeader:
    """Read a GGUF file's metadata and tensor table (not the tensor data), in well under a second.

    `gguf.GGUFReader` builds numpy views per metadata item: about 30 s for SmolLM2's 49k-token vocabulary on 2 cores.

    Example:
        ```python
        >>> header = read_gguf_header(smollm2_gguf_path())
        >>> header.value("llama.block_count"), header.tensors["blk.0.attn_q.weight"]
        (30, (3, (576, 576)))
        ```
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic bytes)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{path} is GGUF version {version}; versions 2 and 3 are read")
        pos, metadata, tensors = 24, {}, {}
        for _ in range(n_kv):
            key, pos = _read_string(buf, pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            item = struct.unpack_from("<I", buf, pos + 4)[0] if vtype == ARRAY else None
            value, pos = _read_value(buf, pos + 4, vtype)
            metadata[key] = (value, vtype, item)
        for _ in range(n_tensors):
            name, pos = _read_string(buf, pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            ggml_type, _offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            tensors[name] = (ggml_type, tuple(reversed(dims)))  # ggml lists the fastest-moving dimension first
    return GGUFHeader(metadata, tensors)


def tensor_names(model):
    """Yield `(gguf name, state-dict key)` for every tensor the model's GGUF holds.

    Raises:
        ValueError: for a tensor llama.cpp has no name for.
    """
    config = model.config
    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == ARCHITECTURES[config.model_type])
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    tied = getattr(config, "tie_word_embeddings", False)
    for key in model.state_dict():
        if tied and key == "lm_head.weight":
            continue  # llama.cpp (and transformers' loader) tie the head when output.weight is absent
        base, _, suffix = key.rpartition(".")
        gguf_name = names.get_name(base)
        if gguf_name is None:
            raise ValueError(f"tensor {key!r} has no llama.cpp name for {ARCHITECTURES[config.model_type]}")
        yield f"{gguf_name}.{suffix}", key


def source_types(model, header: GGUFHeader) -> dict[str, int]:
    """The source's ggml type for every tensor name of the grown model (original layers by their original index)."""
    from ..growth.record import growth_record

    record = growth_record(model)
    old = record.old_indices if record is not None else range(model.config.num_hidden_layers)
    original = {f"blk.{i}.": f"blk.{j}." for j, i in enumerate(old)}  # grown stack index -> original index
    role = lambda name: name.split(".", 2)[2] if name.startswith("blk.") else name  # noqa: E731
    by_role: dict[str, Counter] = {}
    for name, (ggml_type, _) in header.tensors.items():
        by_role.setdefault(role(name), Counter())[ggml_type] += 1
    # Any matrix type, for a tensor the source lacks (an untied output.weight where the source tied it).
    fallback = Counter(t for t, shape in header.tensors.values() if len(shape) == 2)
    types = {}
    for name, _ in tensor_names(model):
        prefix = name[: name.index(".", 4) + 1] if name.startswith("blk.") else ""
        source = original.get(prefix, "new.") + role(name) if prefix else name
        # a new block has no source tensor: the type the source uses most for that tensor
        counts = by_role.get(role(name), fallback)
        types[name] = header.tensors[source][0] if source in header.tensors else counts.most_common(1)[0][0]
    return types
