"""Tiny random models of every supported family, built from configs (no Hub access).

Used by the test-suite and handy for users' own tests. Norm weights are drawn away from 1
(and biases away from 0) so that a test of exactness cannot pass by accident.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as tf
from torch import nn

VOCAB = 128
_TEXT = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64)
_DECODER = dict(**_TEXT, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
_VISION = dict(
    hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64, image_size=16, patch_size=4, num_channels=3
)
SLIDING_WINDOW = 6

# model_type -> (config class, model class, config kwargs)
TINY = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(_DECODER)),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, dict(_DECODER, sliding_window=SLIDING_WINDOW)),
    "qwen2": (
        tf.Qwen2Config,
        tf.Qwen2ForCausalLM,
        dict(_DECODER, use_sliding_window=True, sliding_window=SLIDING_WINDOW, max_window_layers=2),
    ),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(_DECODER, head_dim=8)),
    "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, dict(_DECODER, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM, dict(_DECODER, head_dim=8)),
    "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM, dict(_DECODER, head_dim=8, sliding_window=SLIDING_WINDOW)),
    "gemma3_text": (
        tf.Gemma3TextConfig,
        tf.Gemma3ForCausalLM,
        dict(
            _DECODER,
            head_dim=8,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        ),
    ),
    "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel, dict(vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4, n_positions=128, bos_token_id=0, eos_token_id=0)),
    "gpt_neox": (tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM, dict(_TEXT, max_position_embeddings=128)),
    "bert": (tf.BertConfig, tf.BertForSequenceClassification, dict(_TEXT, num_labels=3, max_position_embeddings=64)),
    "roberta": (
        tf.RobertaConfig,
        tf.RobertaForSequenceClassification,
        dict(_TEXT, num_labels=3, max_position_embeddings=64, pad_token_id=1),
    ),
    "vit": (tf.ViTConfig, tf.ViTForImageClassification, dict(_VISION, num_labels=3)),
    "deit": (tf.DeiTConfig, tf.DeiTForImageClassification, dict(_VISION, num_labels=3)),
    "dinov2": (tf.Dinov2Config, tf.Dinov2ForImageClassification, dict(_VISION, num_labels=3)),
}
DECODERS = [k for k in TINY if TINY[k][1].__name__.endswith("CausalLM") or k == "gpt2"]
ENCODERS = ["bert", "roberta"]
VISION = ["vit", "deit", "dinov2"]
SLIDING = ["mistral", "qwen2", "gemma2", "gemma3_text"]


def tiny_model(model_type: str, *, seed: int = 0, **overrides) -> nn.Module:
    """A tiny fp32 model of `model_type` in eval mode, with non-trivial norm weights.

    Example:
        ```python
        >>> model = tiny_model("llama")
        >>> model.config.num_hidden_layers
        4
        ```
    """
    config_cls, model_cls, kwargs = TINY[model_type]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**kwargs, **overrides}))
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, module in model.named_modules():
            if "norm" in type(module).__name__.lower() or isinstance(module, nn.LayerNorm):
                weight = getattr(module, "weight", None)
                if isinstance(weight, torch.Tensor):
                    weight.add_(0.5 * torch.randn(weight.shape, generator=generator))
                bias = getattr(module, "bias", None)
                if isinstance(bias, torch.Tensor):
                    bias.add_(0.1 * torch.randn(bias.shape, generator=generator))
    return model.eval()


def tiny_inputs(model: nn.Module, *, batch: int = 2, seq: int = 12, seed: int = 0) -> dict:
    """Random inputs with labels matching the model's head (token ids or pixels)."""
    generator = torch.Generator().manual_seed(seed)
    config = model.config
    if hasattr(config, "image_size"):
        pixels = torch.randn(batch, config.num_channels, config.image_size, config.image_size, generator=generator)
        return {"pixel_values": pixels, "labels": torch.randint(0, config.num_labels, (batch,), generator=generator)}
    ids = torch.randint(2, config.vocab_size, (batch, seq), generator=generator)
    if type(model).__name__.endswith("SequenceClassification"):
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.randint(0, config.num_labels, (batch,), generator=generator)}
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def tiny_rows(model: nn.Module, n: int, seed: int = 0, seq: int = 12) -> list[dict]:
    """`tiny_inputs` as `n` rows (the list-of-rows data form), for the functions that take data."""
    batch = tiny_inputs(model, batch=n, seq=seq, seed=seed)
    return [{k: v[i] for k, v in batch.items()} for i in range(n)]


def model_output(model: nn.Module, inputs: dict) -> torch.Tensor:
    """Logits of the model's head (what exactness is judged on)."""
    with torch.no_grad():
        return model(**{k: v for k, v in inputs.items() if k != "labels"}).logits


def byte_level_tokenizer(texts: list[str], *, vocab_size: int = 300) -> tf.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `texts` here (no download): 256 byte tokens, 3 specials, merges.

    Example:
        ```python
        >>> tok = byte_level_tokenizer(["To be, or not to be"] * 10)
        >>> tok.decode(tok("to be").input_ids)
        'to be'
        ```
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "<eos>", "<unk>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


# FSDP2 on gloo CPU processes in full precision: recipes/accelerate_configs/fsdp.yaml but for mixed precision
# (bf16 on CPU would not compare with an fp32 single-process run).
FSDP2_CPU_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
mixed_precision: 'no'
num_machines: 1
num_processes: 2
"""


def fsdp2_cpu_config(folder) -> Path:
    """Write `FSDP2_CPU_CONFIG` as `folder/fsdp2_cpu.yaml` (an `accelerate_config` for multi-worker trials on CPU)."""
    path = Path(folder) / "fsdp2_cpu.yaml"
    path.write_text(FSDP2_CPU_CONFIG)
    return path
