"""Memory planner: what training a grown model needs per device, from its config alone (no weights, no network).

The grown model is built on the meta device (`from_config` + `grow_depth`, no storage), the trainable set is
chosen as the trainer chooses it (`trainable.setup_trainable`), and one forward of the layer stack runs on
fake tensors (`torch._subclasses.FakeTensorMode`: shapes and dtypes, no data) under
`torch.autograd.graph.saved_tensors_hooks`, which sees every tensor autograd keeps for backward. So the
activation figure is what this family's own forward saves, at this batch and sequence length, with these
weights frozen, not a formula per family. Per device:

- parameters: every weight at its dtype (a 4-/8-bit base: the original layers' linear weights at 0.5625 /
  1.0625 bytes per weight, NF4 or int8 plus fp32 scales, at most one per 64 weights; new blocks, embeddings,
  norms and the head stay at the dtype); divided by the device count under ZeRO-3 / FSDP (plus the one
  layer gathered whole while it runs);
- gradients: one per trainable weight at the dtype (divided under ZeRO-2/3 / FSDP); DDP adds its buckets (one
  more copy);
- optimizer state: AdamW's two fp32 moments per trainable weight (divided under ZeRO-1/2/3 / FSDP), plus the
  fp32 temporaries of its multi-tensor step (one moment's size);
- activations: what the forward saves (with gradient checkpointing: each checkpointed layer's input, plus
  one layer's saved tensors during its recomputation), plus the loss head as the trainer runs it (the chunked
  cross-entropy keeps the supervised rows' hidden states and `dl/dh`; the plain head an fp32 `[tokens, vocab]`
  log-softmax), plus the larger transient of the two: backward's gradient buffers at one node (twice the
  largest saved tensor) or the head's (one `[chunk, vocab]` fp32 chunk; the plain head's logits and gradient).

The total is their sum: an upper bound of the peak, since a step's gradients appear as its activations are
freed. Not counted: the frozen-prefix cache (`examples x seq x hidden` at its dtype, in CPU memory unless it
takes under a quarter of the GPU's free memory), the CUDA context and allocator fragmentation (about
0.5-1 GiB on a GPU), the data and the Python process.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import re
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from unittest import mock

import torch
from torch import nn

from ..growth.towers import resolve_family
from ..utils import check_int

TRAINABLE = ("new", "new+lora", "full")
QUANTIZE = ("4bit", "8bit")
# Bytes per weight of a quantized linear layer: NF4 (4 bits + an fp32 absmax per block of 64) and int8 (8 bits +
# an fp32 scale per output row, a few % at most); what bitsandbytes stores without double quantization.
QUANT_BYTES = {"4bit": 0.5 + 4 / 64, "8bit": 1.0 + 4 / 64}
ADAM_MOMENTS = 2
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
GiB = 2**30


def parse_memory_size(text: str) -> int:
    """Bytes in a size such as `"80GiB"`, `"80GB"`, `"24g"`, `"1.5TiB"` or `"81920MiB"`; a `ValueError` otherwise.

    Example:
        ```python
        >>> parse_memory_size("80GiB"), parse_memory_size("80GB")
        (85899345920, 80000000000)
        ```
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"device memory must be a size such as 80GiB, 80GB or 24g, got {text!r}")
    value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"device memory must be a positive size, got {text!r}")
    return int(value)


@dataclass
class MemoryPlan:
    """Predicted memory of one training arm, per device, in bytes (`hf_depthgrow.training.memory_plan`)."""

    trainable: str
    parameters: int  # weights in the grown model (LoRA's included)
    trainable_parameters: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    total_bytes: int
    device_memory: int | None = None
    fits: bool | None = None
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class PlanSettings:
    """What the planner is asked: the arm, the batch and the parallel layout (validated in `__post_init__`)."""

    positions: list[int] | str  # insertion points, or a preset such as "interleave:8" (`grow_depth`'s forms)
    trainable: str = "new"
    seq: int = 512
    batch: int = 1
    gradient_checkpointing: bool = False
    quantize: str | None = None
    gpus: int = 1
    zero: int | None = None
    fsdp: bool = False
    dtype: str = "float32"
    lora_r: int = 8
    chunked_loss: str = "auto"

    def __post_init__(self):
        if self.trainable not in TRAINABLE:
            raise ValueError(f"trainable must be one of {TRAINABLE}, got {self.trainable!r}")
        for name in ("seq", "batch", "gpus", "lora_r"):
            check_int(name, getattr(self, name), 1)
        if self.quantize is not None and self.quantize not in QUANTIZE:
            raise ValueError(f"quantize must be one of {QUANTIZE} or None, got {self.quantize!r}")
        if self.quantize and self.trainable == "full":
            raise ValueError("a quantized base cannot train in full: use trainable 'new' or 'new+lora'")
        if self.zero is not None and self.zero not in (1, 2, 3):
            raise ValueError(f"zero must be 1, 2 or 3, got {self.zero!r}")
        if self.zero is not None and self.fsdp:
            raise ValueError("give ZeRO or FSDP, not both")
        if (self.zero is not None or self.fsdp) and self.gpus < 2:
            raise ValueError("ZeRO and FSDP shard over several devices: set gpus >= 2")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if not self.positions:
            raise ValueError("positions is empty: give at least one insertion point")
        if isinstance(self.positions, str):
            from ..growth.placement import check_placement

            self.positions = check_placement(self.positions)


def load_config(name_or_path: str):
    """The transformers config of an embedded name, a folder, a `config.json` file or a Hub id (no weights read)."""
    from transformers import AutoConfig

    from ..hub.loading import check_model_source

    path = Path(str(name_or_path)).expanduser()
    if path.is_file() and path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{path} is not a readable config.json: {err}") from None
        if "model_type" not in data:
            raise ValueError(f"{path} has no model_type: not a transformers config.json")
        return type(AutoConfig.for_model(data["model_type"])).from_dict(data)
    kind = check_model_source(str(name_or_path))
    if kind == "embedded":
        from ..data.models import minilm_path, smollm2_path

        path = smollm2_path() if str(name_or_path) == "smollm2" else minilm_path()
    return AutoConfig.from_pretrained(str(path) if kind != "hub" else str(name_or_path), trust_remote_code=False)


def meta_model(config, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The config's causal-LM (or saved architecture) on the meta device: shapes and dtypes, no storage."""
    import transformers

    config = copy.deepcopy(config)  # growing writes into the model's config: never into the caller's
    names = list(getattr(config, "architectures", None) or [])
    cls = next((getattr(transformers, n) for n in names if hasattr(transformers, n)), None)
    with torch.device("meta"):
        if cls is not None:
            return cls._from_config(config, dtype=dtype)
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def grown_meta_model(config, settings: PlanSettings) -> tuple[nn.Module, list]:
    """`(model, trainable named parameters)`: the grown meta model with `requires_grad` set as the trainer sets it."""
    from ..growth.engine import grow_depth
    from .config import TrainConfig
    from .trainable import set_train_mode, setup_trainable

    model = meta_model(config, getattr(torch, settings.dtype))
    _, stack, _ = resolve_family(model)
    from ..growth.checks import check_positions

    positions = settings.positions
    if not isinstance(positions, str):
        positions = check_positions(list(positions), len(stack))  # one line naming the bad position, before any work
    grow_depth(model, positions, verify=False)  # nothing to verify on meta: growth is exact by construction
    cfg = TrainConfig(trainable=settings.trainable, lora_r=settings.lora_r, lora_alpha=2 * settings.lora_r, progress_bar=False)
    with warnings.catch_warnings():  # peft asks the model a deprecated question; nothing the user can act on
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        trainable = setup_trainable(model, cfg)
    set_train_mode(model, trainable.train_modules, True)
    return model, trainable.named


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


@contextlib.contextmanager
def _one_sequence_per_row():
    """transformers looks for packed sequences in the position ids; on fake tensors it cannot read them and assumes
    packing, which materialises a `[batch, 1, seq, seq]` mask and repeats grouped key/value heads. The trainer's
    rows are one sequence each, so the planner tells it so: the causal kernel without a mask, as in training."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    if not hasattr(masking_utils, "find_packed_sequence_indices"):
        yield
        return
    with mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda position_ids: None):
        yield


def saved_activations(model: nn.Module, batch: int, seq: int) -> dict:
    """What autograd keeps from one forward of the model's body (embeddings, layer stack, final norm), in bytes.

    The (meta) model is copied onto fake CPU tensors, so that attention takes the kernel a real device takes
    (flash attention keeps `q, k, v`, the output and its log-sum-exp; meta tensors would take the math path,
    which keeps the `[seq, seq]` probabilities). Returns `{"layers": [bytes saved inside each stack layer (its
    hosted adapters included)], "inputs": [bytes of each layer's hidden-state input], "outside": bytes saved
    outside the layers, "largest_tensor": bytes of the largest tensor saved in a layer, "hidden": (tokens, hidden
    size)}`. A tensor saved twice (or as views of one storage)
    counts once; weights and buffers are not activations.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = copy.deepcopy(model)
    with mode:
        model.to_empty(device="cpu")  # the copy's tied weights come untied: its weights are not counted here
    _, stack, _ = resolve_family(model)
    where, seen = ["outside"], {}
    layers, inputs = [0] * len(stack), [0] * len(stack)

    def enter(i):
        def hook(module, args, kwargs):
            where[0] = i
            hidden = args[0] if args else kwargs.get("hidden_states")
            inputs[i] = hidden.untyped_storage().nbytes() if isinstance(hidden, torch.Tensor) else 0

        return hook

    def leave(module, args, output):
        where[0] = "outside"

    for i, layer in enumerate(stack):  # prepend / append: hosted adapters' hooks run inside the window
        layer.register_forward_pre_hook(enter(i), with_kwargs=True, prepend=True)
        layer.register_forward_hook(leave)
    weights = {_storage_key(t) for t in (*model.parameters(), *model.buffers())}

    def pack(tensor):
        key = _storage_key(tensor)
        if key not in weights and key not in seen:
            seen[key] = (where[0], tensor.untyped_storage().nbytes())
        return tensor

    # No attention mask: the trainer's rows are unpadded blocks, whose all-ones mask transformers drops.
    with mode, _one_sequence_per_row(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model.get_decoder()(input_ids=torch.zeros(batch, seq, dtype=torch.long), use_cache=False)
        hidden = tuple(out.last_hidden_state.shape)
    outside = 0
    for place, nbytes in seen.values():
        if place == "outside":
            outside += nbytes
        else:
            layers[place] += nbytes
    largest = max((nbytes for place, nbytes in seen.values() if place != "outside"), default=0)
    return {"layers": layers, "inputs": inputs, "outside": outside, "largest_tensor": largest, "hidden": (hidden[0] * hidden[1], hidden[-1])}


def _parameter_bytes(model: nn.Module, quantize: str | None) -> int:
    """Weight bytes of the (meta) grown model; with `quantize`, the original layers' linear weights at `QUANT_BYTES`."""
    from ..growth.engine import new_block_parameters

    new = {id(p) for _, p in new_block_parameters(model)}
    _, stack, _ = resolve_family(model)
    quantized = set()
    if quantize:  # what a BitsAndBytesConfig quantizes: the stack's linear layers (not the head), never a new block
        quantized = {id(m.weight) for m in stack.modules() if isinstance(m, nn.Linear) and id(m.weight) not in new}
    total = 0
    for param in model.parameters():  # each tied weight once
        if id(param) in quantized:
            total += math.ceil(param.numel() * QUANT_BYTES[quantize])
        else:
            total += param.numel() * param.element_size()
    return total


def _loss_head(model: nn.Module, tokens: int, hidden: int, itemsize: int, chunked_loss: str) -> tuple[int, int]:
    """`(saved, transient)` bytes of the trainer's causal-LM loss on `tokens` supervised tokens (`chunked_loss.py`)."""
    from ..chunked_loss import resolve_chunk_size

    head = model.get_output_embeddings()
    vocab = getattr(head, "out_features", None) or int(model.config.vocab_size)
    chunk = resolve_chunk_size(None if chunked_loss == "off" else chunked_loss, tokens, vocab)
    if chunk is None:  # plain head: fp32 log-softmax kept; the logits and their gradient in backward
        return tokens * vocab * 4, tokens * vocab * (itemsize + 4)
    # the supervised rows' hidden states and dl/dh, kept; one chunk's logits (fp32) and their log-softmax in place
    return 2 * tokens * hidden * itemsize, min(chunk, tokens) * vocab * 4


def _activation_bytes(model: nn.Module, settings: PlanSettings, start: int) -> tuple[int, dict]:
    saved = saved_activations(model, settings.batch, settings.seq)
    layers = saved["layers"]
    tokens, hidden = saved["hidden"]
    itemsize = torch.empty((), dtype=getattr(torch, settings.dtype)).element_size()
    head_saved, head_transient = _loss_head(model, settings.batch * (settings.seq - 1), hidden, itemsize, settings.chunked_loss)
    if settings.gradient_checkpointing:
        # Each checkpointed layer keeps its input; the one being recomputed holds its saved tensors.
        body = sum(saved["inputs"][i] for i in range(start, len(layers)) if layers[i]) + max(layers, default=0)
        body += sum(layers[:start])
    else:
        body = sum(layers)
    # Backward frees a layer's saved tensors as it goes; at a node it holds the gradients of its output and of its
    # input, at most about twice the largest saved tensor (an MLP's [tokens, intermediate]).
    transient = max(2 * saved["largest_tensor"], head_transient)
    total = body + saved["outside"] + head_saved + transient
    details = {"saved_per_layer": layers, "saved_outside": saved["outside"], "loss_head_saved": head_saved,
               "loss_head_transient": head_transient, "tokens": tokens}
    return total, details


def plan_memory(config, settings: PlanSettings, device_memory: int | None = None) -> MemoryPlan:
    """Predict what training `settings.trainable` of the config's model grown at `settings.positions` needs per device.

    Args:
        config: A transformers config (see `load_config`), or a model folder / `config.json` / Hub id / `"smollm2"`.
        settings: The arm, the batch per device, the sequence length, checkpointing, quantization and layout.
        device_memory: Bytes per device; sets `fits`.

    Returns:
        `MemoryPlan` (bytes per device; see the module docstring for what each figure holds).

    Example:
        ```python
        >>> plan = plan_memory("smollm2", PlanSettings(positions=[24], seq=512, batch=8), device_memory=80 * GiB)
        >>> plan.trainable_parameters, plan.fits
        (3540096, True)
        ```
    """
    if not hasattr(config, "to_dict"):
        config = load_config(config)
    model, named = grown_meta_model(config, settings)
    from ..growth.prefix import lowest_new_index

    start = 0 if settings.trainable == "full" else (lowest_new_index(model) or 0)
    n = settings.gpus
    shard_params = settings.fsdp or settings.zero == 3
    shard_grads = shard_params or settings.zero == 2
    shard_states = shard_grads or settings.zero == 1
    trainable = sum(p.numel() for _, p in named)
    grad_itemsize = named[0][1].element_size() if named else 4
    params = _parameter_bytes(model, settings.quantize)
    grads = trainable * grad_itemsize
    if n > 1 and not (settings.zero or settings.fsdp):
        grads *= 2  # DDP's gradient buckets: a second copy, all-reduced
    states = trainable * 4 * ADAM_MOMENTS
    optimizer_step = trainable * 4  # the multi-tensor step's temporaries
    activations, details = _activation_bytes(model, settings, start)
    per_device = {
        "parameter_bytes": math.ceil(params / n) if shard_params else params,
        "gradient_bytes": math.ceil(grads / n) if shard_grads else grads,
        "optimizer_bytes": math.ceil((states + optimizer_step) / n) if shard_states else states + optimizer_step,
    }
    if shard_params:  # one layer's weights are gathered whole while it runs
        _, stack, _ = resolve_family(model)
        per_device["parameter_bytes"] += max(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in stack)
    total = sum(per_device.values()) + activations
    details.update(checkpointed_from=start if settings.gradient_checkpointing else None, settings=asdict(settings))
    return MemoryPlan(
        trainable=settings.trainable, parameters=sum(p.numel() for p in model.parameters()), trainable_parameters=trainable,
        activation_bytes=activations, total_bytes=total, device_memory=device_memory,
        fits=None if device_memory is None else total <= device_memory, details=details, **per_device,
    )
