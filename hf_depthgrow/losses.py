"""The model's own head loss, per example: one definition shared by probe, trainer and evaluator.

- Causal LMs: next-token cross-entropy. Labels are shifted inside (as transformers does);
  `-100` marks unsupervised tokens. An example's loss is the mean over its supervised
  tokens; a data-set loss is the mean over all supervised tokens (token-weighted), which is
  what the model's own `outputs.loss` computes for one batch.
- Classifiers (sequence or image): cross-entropy per example; a data-set loss is the mean
  over examples.

`hf_depthgrow.chunked_loss` builds on these: `batch_example_losses(model, batch)` computes the same
`ExampleLosses` from a causal LM without its full `[batch, seq, vocab]` logits (what the trainer, probe and
evaluator call).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
#: The column naming the document (file, page, table row) each example came from. It travels with the rows and
#: batches of the data contract for document-level statistics (cluster bootstrap, splits by document) and is
#: never given to a model.
DOCUMENT_COLUMN = "document"


@dataclass
class ExampleLosses:
    """Per-example summed loss and weight (supervised tokens, or 1 per example for classifiers).

    `per_example = total / weight`; the data-set loss is `total.sum() / weight.sum()`.
    """

    total: torch.Tensor
    weight: torch.Tensor

    @property
    def per_example(self) -> torch.Tensor:
        return self.total / self.weight.clamp_min(1)

    def mean(self) -> torch.Tensor:
        return self.total.sum() / self.weight.sum().clamp_min(1)


def is_causal_lm(model) -> bool:
    name = type(model).__name__
    return name.endswith("ForCausalLM") or name.endswith("LMHeadModel")


def labels_of(batch: dict) -> torch.Tensor:
    labels = batch.get("labels")
    if labels is None:
        raise ValueError(f"the batch has no 'labels' (keys: {sorted(batch)}); the loss needs them.")
    return labels


def example_losses(logits: torch.Tensor, labels: torch.Tensor, *, causal: bool) -> ExampleLosses:
    """Summed loss and weight per example from logits and labels (fp32 arithmetic)."""
    if causal:
        # Shift the labels, not the logits: slicing [B, T, V] logits copies them (and their gradient),
        # which with a 49k vocabulary costs about as much as a layer. The last position gets IGNORE_INDEX.
        shift_labels = F.pad(labels[:, 1:].to(logits.device), (0, 1), value=IGNORE_INDEX)
        mask = shift_labels != IGNORE_INDEX
        token_loss = F.cross_entropy(
            (logits if logits.dtype == torch.float32 else logits.float()).reshape(-1, logits.size(-1)),
            shift_labels.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="none",
        ).view(shift_labels.shape)
        return ExampleLosses(token_loss.sum(dim=1), mask.sum(dim=1).to(token_loss.dtype))
    if logits.dim() != 2:
        raise ValueError(f"classifier logits must be [batch, classes], got {tuple(logits.shape)}")
    labels = labels.to(logits.device)
    loss = F.cross_entropy(logits.float(), labels, reduction="none")
    return ExampleLosses(loss, torch.ones_like(loss))


def model_inputs(batch: dict) -> dict:
    """The batch without labels (so the model does not compute its own reduced loss) and without the document column."""
    return {k: v for k, v in batch.items() if k not in ("labels", DOCUMENT_COLUMN)}
