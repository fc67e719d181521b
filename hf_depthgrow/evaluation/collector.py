"""Per-example losses of the sides of a paired evaluation ("old", "new", and any others run in the same pass)."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from ..chunked_loss import model_example_losses
from ..losses import ExampleLosses, example_losses


class Collector:
    """Per-example losses (and, for classifiers, predictions) of the "old" and "new" model, batch by batch.

    Further sides (e.g. a stepping stone run in the same pass) are kept under their own names, and a
    side computed once can serve another evaluation of the same examples (`take`).
    """

    def __init__(self, task: str):
        self.task = task
        self.total: dict[str, list] = defaultdict(list)
        self.weight: dict[str, list] = defaultdict(list)
        self.preds: dict[str, list] = defaultdict(list)
        self.refs: list = []

    def has(self, which: str) -> bool:
        return bool(self.total.get(which))

    def take(self, which: str, other: "Collector", source: str) -> None:
        """Use side `source` of `other`, computed on the same examples in the same order, as side `which`."""
        if other.task != self.task or not other.has(source):
            raise ValueError(f"cannot reuse side {source!r}: the other evaluation has no such losses of a {self.task} model")
        self.total[which], self.weight[which] = list(other.total[source]), list(other.weight[source])
        self.preds[which] = list(other.preds.get(source, []))
        if not self.refs:
            self.refs = list(other.refs)

    def add(self, which: str, logits: torch.Tensor, labels: torch.Tensor) -> None:
        self.add_losses(which, example_losses(logits, labels, causal=self.task == "causal_lm"))
        if self.task != "causal_lm":
            self.preds[which].append(logits.argmax(dim=-1).cpu())
            if which == "old":
                self.refs.append(labels.cpu())

    def add_losses(self, which: str, losses: ExampleLosses) -> None:
        self.total[which].append(losses.total.detach().double().cpu())
        self.weight[which].append(losses.weight.detach().double().cpu())

    def run(self, which: str, model: nn.Module, inputs: dict, labels: torch.Tensor, chunk_size) -> None:
        """One forward of `model`: a causal LM's losses chunked over tokens where that pays, a classifier's with predictions."""
        if self.task == "causal_lm":
            self.add_losses(which, model_example_losses(model, inputs, labels, causal=True, chunk_size=chunk_size))
        else:
            self.add(which, model(**inputs).logits, labels)

    def to_tensors(self, sides) -> dict[str, torch.Tensor]:
        """`sides` as flat tensors (`<side>/total`, `<side>/weight`, a classifier's `<side>/preds` and `refs`), for `from_tensors`."""
        out = {}
        for side in sides:
            out[f"{side}/total"], out[f"{side}/weight"] = torch.cat(self.total[side]), torch.cat(self.weight[side])
            if self.preds.get(side):
                out[f"{side}/preds"] = torch.cat(self.preds[side])
        if self.refs:
            out["refs"] = torch.cat(self.refs)
        return out

    @classmethod
    def from_tensors(cls, task: str, tensors: dict[str, torch.Tensor]) -> "Collector":
        """The sides `to_tensors` wrote, each as one batch."""
        collect = cls(task)
        for name, t in tensors.items():
            side, _, part = name.rpartition("/")
            if name == "refs":
                collect.refs = [t]
            elif side and part in ("total", "weight", "preds"):
                getattr(collect, part)[side] = [t]
            else:
                raise ValueError(f"unknown losses tensor {name!r}")
        return collect

    def cat(self, which: str) -> ExampleLosses:
        return ExampleLosses(torch.cat(self.total[which]), torch.cat(self.weight[which]))

    def predictions(self) -> tuple:
        """Old predictions, new predictions and references as arrays (`None` for a causal LM)."""
        joined = [torch.cat(x).numpy() if x else None for x in (self.preds["old"], self.preds["new"], self.refs)]
        return tuple(joined)
