"""Chunked output head + cross-entropy: the causal-LM loss without the full `[batch, seq, vocab]` logits.

The plain loss (`hf_depthgrow.losses.example_losses` on `model(**inputs).logits`) holds the logits,
their log-softmax and, in backward, their gradient: several `[tokens, vocab]` fp32 arrays (100 MB each
for SmolLM2-135M at 512 tokens, five times that per token for a 256k vocabulary). Here the model's own
forward runs with `logits_to_keep=1` (its head sees one position), the final-normed hidden states are
taken from its decoder (`model.get_decoder()`) by a forward hook, and the head
(`model.get_output_embeddings()`), the family's logit transform (`logit_transform`) and the
cross-entropy run over chunks of supervised tokens inside one autograd Function that keeps one chunk's
logits alive at a time, in forward and backward:

- a chunk's logits become its log-softmax and then their gradient in place: one `[chunk, vocab]`
  buffer (a known logit transform, e.g. Gemma's soft-capping, goes through autograd: a few buffers);
- the gradient of each token's loss with respect to its hidden state, `(dl/draw) @ W`, is computed in
  the forward (the same matmul the plain backward does; `[tokens, hidden]`, small) and scaled by the
  upstream gradient in backward;
- where the head's weight trains (tied embeddings, `trainable="full"`), its gradient is accumulated in
  the forward too and scaled in backward when the upstream gradient is the same for every token (a
  token-weighted sum or mean: the trainer and the probe); any other upstream gradient recomputes the
  chunks in backward, exactly.

So no FLOP is added in the usual cases (`torch.utils.checkpoint` would run the head matmul twice).
The body still runs through the model's own forward, so `growth.prefix.start_at`, `bypass_new_blocks`
and the probe's hooks on the layer stack apply unchanged.

Safety: the first time a model takes the chunked path, a no-grad forward of that batch (autocast off, so
fp32 for an fp32 model; random state untouched) compares the model's own log-probabilities of every
vocabulary entry at a few supervised tokens with this module's; if they differ by more than
`CHECK_TOLERANCE` (relative; scaled by the dtype's eps for a bf16/fp16 model), or
the head is not an `nn.Linear`, or the forward takes no `logits_to_keep`, the model gets the plain loss
from then on, with a warning that says why. The decision is kept per model (`chunked_loss_status`).
"""

from __future__ import annotations

import inspect
import math
import warnings
import weakref
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from .losses import IGNORE_INDEX, ExampleLosses, example_losses, is_causal_lm, labels_of, model_inputs

# Tokens per chunk under "auto": `max(MIN_CHUNK_TOKENS, CHUNK_ELEMENTS // vocab)`. A chunk then holds about
# 2^23 logits (32 MiB in fp32) up to a 128k vocabulary, 64 rows above; at least 64 rows keep the head matmul
# efficient (measured on a 2-core CPU at d = 576, vocab 49152: 32-row chunks cost 25-35% more head time
# than the plain path, 128-256-row chunks 3-13% less, as their buffers stay in cache and heap).
CHUNK_ELEMENTS = 1 << 23
MIN_CHUNK_TOKENS = 64
# In place, the log-softmax of a chunk runs over sub-blocks of at most 2^20 entries (4 MiB in fp32).
SUB_ELEMENTS = 1 << 20
# "auto" chunks when the plain path would hold at least two chunks' worth of logits (2^24 = 64 MiB in
# fp32; with their log-softmax and gradient >= 192 MiB); below that chunking saves nothing.
AUTO_MIN_ELEMENTS = 2 * CHUNK_ELEMENTS
# Self-check: |chunked - plain| <= CHECK_TOLERANCE * max(1, |plain|) for every log-probability of the
# checked tokens (fp32); at most CHECK_ROWS tokens, so the check never holds more than CHECK_ROWS x vocab.
CHECK_TOLERANCE = 1e-6
CHECK_ROWS = 32

_DECISIONS: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()  # "" = chunked is exact


def logit_transform(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The elementwise map the model's forward applies to the head's output, for the families known here.

    Gemma 2/3 (any config with `final_logit_softcapping`): `cap * tanh(x / cap)`; Cohere: `x * logit_scale`;
    Granite: `x / logits_scaling`. The operations are those of the model's own forward, in its order, so
    fp32 results are identical. Anything else returns `None`; the self-check catches a family that does more.

    Example:
        ```python
        >>> from hf_depthgrow.testing import tiny_model
        >>> logit_transform(tiny_model("gemma2", final_logit_softcapping=30.0))(torch.tensor([60.0]))
        tensor([28.9210])
        ```
    """
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    cap = getattr(text, "final_logit_softcapping", None)
    if cap:
        return lambda x: torch.tanh(x / cap) * cap
    model_type = str(getattr(config, "model_type", ""))
    if model_type in ("cohere", "cohere2", "cohere2_moe") and getattr(text, "logit_scale", None) is not None:
        scale = getattr(model, "logit_scale", text.logit_scale)
        return lambda x: x * scale
    if model_type in ("granite", "granitemoe", "granitemoeshared", "granitemoehybrid"):
        scaling = text.logits_scaling
        return lambda x: x / scaling
    return None


def _log_softmax_(x: torch.Tensor) -> torch.Tensor:
    """`torch.log_softmax(x, -1)` written into `x`, a few rows at a time: one `[chunk, vocab]` array, not two."""
    step = max(1, SUB_ELEMENTS // x.shape[-1])
    for s in range(0, x.shape[0], step):
        x[s : s + step] = torch.log_softmax(x[s : s + step], dim=-1)  # row by row the same kernel: the same values
    return x


def _chunk_grad(raw: torch.Tensor, targets: torch.Tensor, transform) -> tuple[torch.Tensor, torch.Tensor]:
    """Token losses of one chunk of head outputs and their gradient `dl_t/draw_t` (upstream 1 per token).

    Overwrites `raw` (a temporary of the caller's).
    """
    if transform is None:
        logp = _log_softmax_(raw if raw.dtype == torch.float32 else raw.float())
        losses = -logp.gather(1, targets[:, None]).squeeze(1)
        d = logp.exp_()  # softmax - onehot: what log_softmax + nll give in backward, in place
        d[torch.arange(len(targets), device=d.device), targets] -= 1
        return losses, d.to(raw.dtype)
    leaf = raw.detach().requires_grad_(True)
    with torch.enable_grad():
        logits = transform(leaf)
        losses = F.cross_entropy(logits if logits.dtype == torch.float32 else logits.float(), targets, reduction="none")
        (d,) = torch.autograd.grad(losses, leaf, torch.ones_like(losses))
    return losses.detach(), d


def _chunk_losses(raw: torch.Tensor, targets: torch.Tensor, transform) -> torch.Tensor:
    if transform is None and raw.dtype == torch.float32:
        return -_log_softmax_(raw).gather(1, targets[:, None]).squeeze(1)
    logits = transform(raw) if transform is not None else raw
    return F.cross_entropy(logits if logits.dtype == torch.float32 else logits.float(), targets, reduction="none")


def _add_weight_grad(acc: torch.Tensor, d: torch.Tensor, h: torch.Tensor) -> None:
    """`acc += d^T h` (fp32 accumulator; a reduced-precision product is computed as autocast would)."""
    h = h.to(d.dtype)
    if acc.dtype == d.dtype:
        acc.addmm_(d.t(), h)
    else:
        acc += torch.mm(d.t(), h).float()


class _ChunkedHeadCE(torch.autograd.Function):
    """Token losses of `transform(hidden @ weight^T + bias)` against `targets`, `chunk` tokens at a time."""

    @staticmethod
    def forward(ctx, hidden, targets, weight, bias, transform, chunk):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        need_b = bias is not None and ctx.needs_input_grad[3]
        n = hidden.shape[0]
        losses = torch.empty(n, dtype=torch.float32, device=hidden.device)
        d_hidden = torch.empty_like(hidden) if need_h else None
        g_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        g_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        for s in range(0, n, chunk):
            h, y = hidden[s : s + chunk], targets[s : s + chunk]
            raw = F.linear(h, weight, bias)
            losses[s : s + chunk], d = _chunk_grad(raw, y, transform)
            del raw
            if need_h:
                d_hidden[s : s + chunk] = torch.mm(d, weight.to(d.dtype))
            if need_w:
                _add_weight_grad(g_weight, d, h)
            if need_b:
                g_bias += d.sum(0).float()
        ctx.save_for_backward(hidden, targets, weight, bias)
        ctx.transform, ctx.chunk = transform, chunk
        ctx.d_hidden, ctx.g_weight, ctx.g_bias = d_hidden, g_weight, g_bias
        return losses

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_losses):
        hidden, targets, weight, bias = ctx.saved_tensors
        g = grad_losses.float()
        grad_h = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_h = (ctx.d_hidden.float() * g[:, None]).to(hidden.dtype)
        need_w, need_b = ctx.needs_input_grad[2], bias is not None and ctx.needs_input_grad[3]
        if not (need_w or need_b):
            return grad_h, None, None, None, None, None
        # The precomputed weight gradient holds for an upstream gradient that is the same for every token.
        if ctx.g_weight is not None or ctx.g_bias is not None:
            if len(g) == 0 or bool((g == g[0]).all()):
                scale = g[0] if len(g) else 0.0
                grad_w = ctx.g_weight.mul_(scale).to(weight.dtype) if need_w else None
                grad_b = ctx.g_bias.mul_(scale).to(bias.dtype) if need_b else None
                ctx.g_weight = ctx.g_bias = None  # scaled in place: a second backward recomputes
                return grad_h, None, grad_w, grad_b, None, None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        for s in range(0, len(g), ctx.chunk):
            h = hidden[s : s + ctx.chunk]
            _, d = _chunk_grad(F.linear(h, weight, bias), targets[s : s + ctx.chunk], ctx.transform)
            d = d * g[s : s + ctx.chunk, None].to(d.dtype)
            if need_w:
                _add_weight_grad(grad_w, d, h)
            if need_b:
                grad_b += d.sum(0).float()
        return (grad_h, None, grad_w.to(weight.dtype) if need_w else None,
                grad_b.to(bias.dtype) if need_b else None, None, None)


def chunked_token_losses(hidden: torch.Tensor, targets: torch.Tensor, head: nn.Linear, transform=None, *, chunk: int) -> torch.Tensor:
    """Cross-entropy of `transform(head(hidden))` per row of `hidden` `[n, d]`, `chunk` rows at a time.

    Values and gradients (to `hidden` and the head's parameters) are those of the plain computation.

    Example:
        ```python
        >>> head = nn.Linear(8, 1000, bias=False)
        >>> chunked_token_losses(torch.randn(5, 8), torch.tensor([1, 2, 3, 4, 5]), head, chunk=2).shape
        torch.Size([5])
        ```
    """
    params = [hidden, head.weight] + ([head.bias] if head.bias is not None else [])
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in params)):
        # No gradient wanted: the losses alone. The grad mode is checked here because `Function.apply` reports
        # `needs_input_grad` from `requires_grad` whatever the mode: under `no_grad` (every evaluation, line search
        # and selection pass of a model with trainable weights) its forward would also compute gradients nobody reads.
        return _forward_losses(hidden, targets, head.weight, head.bias, transform, int(chunk))
    return _ChunkedHeadCE.apply(hidden, targets, head.weight, head.bias, transform, int(chunk))


def _forward_losses(hidden, targets, weight, bias, transform, chunk: int) -> torch.Tensor:
    """The token losses alone, `chunk` rows at a time (no gradient work)."""
    losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    for s in range(0, hidden.shape[0], chunk):
        losses[s : s + chunk] = _chunk_losses(F.linear(hidden[s : s + chunk], weight, bias), targets[s : s + chunk], transform)
    return losses


def resolve_chunk_size(chunk_size, tokens: int, vocab: int) -> int | None:
    """Tokens per chunk for `chunk_size` (`"auto"`, `"on"`, an int >= 1 or `None`), given the supervised tokens and vocabulary.

    `"auto"` chunks when `tokens * vocab >= AUTO_MIN_ELEMENTS`, `max(MIN_CHUNK_TOKENS, CHUNK_ELEMENTS // vocab)`
    tokens at a time (see the constants); `"on"` always chunks, at that size. `None` (and "auto" below the
    threshold) is the plain path.

    Example:
        ```python
        >>> resolve_chunk_size("auto", 512, 49152), resolve_chunk_size("auto", 64, 32000), resolve_chunk_size(128, 10, 10)
        (170, None, 128)
        ```
    """
    if chunk_size is None:
        return None
    if chunk_size in ("auto", "on"):  # "on": the automatic size, whatever the vocabulary and tokens
        size = max(MIN_CHUNK_TOKENS, CHUNK_ELEMENTS // max(vocab, 1))
        return size if chunk_size == "on" or tokens * vocab >= AUTO_MIN_ELEMENTS else None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be 'auto', 'on', an int >= 1 or None, got {chunk_size!r}")
    return chunk_size


def chunked_loss_status(model: nn.Module) -> str | None:
    """`None` before the model's first chunked call, `""` if the chunked loss passed its check, else why it is off."""
    return _DECISIONS.get(model)


def _structure_problem(model: nn.Module) -> str | None:
    """Why the chunked path cannot apply to this model at all (or `None`)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        return f"its output head is {type(head).__name__}, not an nn.Linear"
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return f"{type(model).__name__}.forward takes no `logits_to_keep`, so its head would still see every token"
    if not hasattr(model, "get_decoder") or model.get_decoder() is model:
        return "no decoder module separate from the head was found (model.get_decoder())"
    return None


def _body(model: nn.Module, run: nn.Module, inputs: dict, keep) -> tuple[torch.Tensor, object]:
    """Run `run` (the model or its wrapper) with `logits_to_keep=keep`; the decoder's hidden states and the output."""
    captured = []
    handle = model.get_decoder().register_forward_hook(lambda mod, args, out: captured.append(out[0]))
    try:
        out = run(**{**inputs, "logits_to_keep": keep})
    finally:
        handle.remove()
    if not captured:
        raise RuntimeError("the model's decoder was not called by its forward")
    return captured[-1], out


@torch.no_grad()
def _self_check(model: nn.Module, inputs: dict, shifted: torch.Tensor, mask: torch.Tensor, transform) -> str:
    """Compare the model's own log-probabilities with the chunked path's at a few supervised tokens ("" = equal).

    The log-probability of every vocabulary entry is the token's loss for every possible target, so equal
    log-probabilities mean equal losses whatever the labels.
    """
    batch = shifted.shape[0]
    cols = torch.nonzero(mask.any(0)).flatten()
    k = max(1, min(len(cols), CHECK_ROWS // batch))
    cols = cols[torch.linspace(0, len(cols) - 1, k).round().long().unique()]
    param = next(model.parameters())
    devices = [param.device] if param.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.autocast(param.device.type, enabled=False):
        hidden, out = _body(model, model, inputs, cols.to(param.device))
        ref = getattr(out, "logits", None)
        if ref is None or hidden.shape[:2] != shifted.shape or ref.shape[:2] != (batch, len(cols)):
            return "the decoder's hidden states or the head's logits do not have the [batch, seq] shape of the labels"
        # The head on the same [batch, k, d] rows as the model's own call (the same matmul, so any difference is
        # structural, not rounding), compared where the loss counts: the supervised tokens, every target.
        raw = model.get_output_embeddings()(hidden[:, cols])
        sel = mask[:, cols]
        ours = torch.log_softmax((transform(raw) if transform is not None else raw)[sel].float(), dim=-1)
        ref = torch.log_softmax(ref[sel].float(), dim=-1)
    tol = CHECK_TOLERANCE * max(1.0, torch.finfo(raw.dtype).eps / torch.finfo(torch.float32).eps)
    err = float(((ours - ref).abs() / ref.abs().clamp_min(1)).max())
    if not math.isfinite(err) or err > tol:
        return (
            f"on its first batch the chunked log-probabilities differ from the model's own by {err:.3g} (relative; "
            f"tolerance {tol:.0e}): its forward does something between the decoder and the logits that this module "
            f"does not reproduce, e.g. a logit transform it does not know (model_type "
            f"{getattr(model.config, 'model_type', '?')!r}; transform applied here: {'yes' if transform else 'none'})"
        )
    return ""


def _decide(model: nn.Module, inputs: dict, shifted: torch.Tensor, mask: torch.Tensor) -> str | None:
    """Whether the chunked path is exact for `model` ("" yes, else why not; `None`: undecided, no supervised token yet)."""
    reason = _structure_problem(model)
    if reason is None:
        if not bool(mask.any()):
            return None  # nothing to compare on (and nothing for the head to compute): ask again next batch
        reason = _self_check(model, inputs, shifted, mask, logit_transform(model))
    _DECISIONS[model] = reason
    if reason:
        warnings.warn(f"chunked cross-entropy is off for this {type(model).__name__}: {reason}. Using the plain loss "
                      "(full logits).", stacklevel=4)
    return reason


def model_example_losses(model: nn.Module, inputs: dict, labels: torch.Tensor, *, causal: bool, chunk_size="auto",
                         module: nn.Module | None = None) -> ExampleLosses:
    """Per-example losses of `model` on `inputs` (no labels) and `labels`, chunked over tokens where that pays.

    The same `ExampleLosses` as `example_losses(model(**inputs).logits, labels, causal=causal)`, values and
    gradients, without materialising the full logits for a causal LM with a large vocabulary (see the module
    docstring). Classifiers, `chunk_size=None`, and "auto" below its threshold take the plain path.

    Args:
        model: The model (unwrapped: its head, decoder and config are read from it).
        inputs: Model inputs without `labels`.
        labels: `[batch, seq]` token labels (causal LM, `-100` = unsupervised) or `[batch]` class labels.
        causal: Whether `model` is a causal LM (`hf_depthgrow.losses.is_causal_lm`).
        chunk_size: `"auto"`, tokens per chunk (int), or `None` for the plain path.
        module: What to call instead of `model` (a DDP wrapper of it); default `model`.

    Example:
        ```python
        >>> from hf_depthgrow.testing import tiny_model, tiny_inputs
        >>> model = tiny_model("llama")
        >>> batch = tiny_inputs(model)
        >>> labels = batch.pop("labels")
        >>> model_example_losses(model, batch, labels, causal=True, chunk_size=4).weight
        tensor([11., 11.])
        ```
    """
    run = module if module is not None else model
    chunk = None
    if causal and chunk_size is not None and _DECISIONS.get(model, "") == "":
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        vocab = getattr(head, "out_features", None) or getattr(model.config, "vocab_size", 0)
        shifted = F.pad(labels[:, 1:].to(next(model.parameters()).device), (0, 1), value=IGNORE_INDEX)
        mask = shifted != IGNORE_INDEX
        chunk = resolve_chunk_size(chunk_size, int(mask.sum()), int(vocab))
        if chunk is not None and model not in _DECISIONS:
            chunk = None if _decide(model, inputs, shifted, mask) else chunk
    if chunk is None:
        return example_losses(run(**inputs).logits, labels, causal=causal)
    hidden, _ = _body(model, run, inputs, 1)
    shifted, mask = shifted.to(hidden.device), mask.to(hidden.device)  # a model spread over devices
    batch, seq = shifted.shape
    rows = mask.reshape(-1).nonzero().squeeze(1)
    flat = hidden.reshape(batch * seq, hidden.shape[-1]).index_select(0, rows)
    head = model.get_output_embeddings()
    if len(rows):  # chunks of equal size (511 tokens, at most 170 a chunk: 4 of 128, not 3 of 170 and 1 of 1)
        chunk = -(-len(rows) // -(-len(rows) // chunk))
    losses = chunked_token_losses(flat, shifted.reshape(-1)[rows], head, logit_transform(model), chunk=chunk)
    token_loss = torch.zeros(batch * seq, dtype=losses.dtype, device=losses.device).index_put((rows,), losses)
    token_loss = token_loss.view(batch, seq)
    return ExampleLosses(token_loss.sum(dim=1), mask.sum(dim=1).to(token_loss.dtype))


def batch_example_losses(model, batch: dict, *, chunk_size="auto") -> ExampleLosses:
    """Run `model` on `batch` and return its per-example losses.

    A causal LM's loss runs over chunks of tokens where its vocabulary makes the logits large
    (`model_example_losses`; `chunk_size=None` is the plain path).
    """
    return model_example_losses(model, model_inputs(batch), labels_of(batch), causal=is_causal_lm(model), chunk_size=chunk_size)
