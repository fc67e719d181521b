"""Budgets in fresh data: the training blocks a comparison's largest budget needs, and the epochs of every budget.

Every optimizer step of a trial takes `batch_size` training rows (blocks) from a seeded permutation of the
training set (`training.data_order.DataOrder`), and no block repeats within one pass. A sweep therefore draws
new blocks at every step up to its largest budget exactly when `largest budget x batch_size <= training blocks`.
Past that a budget counts epochs of the same text, not fresh tokens: such a comparison is refused before
anything trains, unless `allow_repeated_data` lets it run (with a warning, and the epochs of every budget in
the report). `compare_plans` and `validate_probe` check this; `hf-depthgrow compare` checks it before its
output folder is staged.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DataPlan", "data_plan", "format_epochs"]


def format_epochs(epochs: float) -> str:
    """`0.83`, `3.33`, `333`: two decimals below 10 epochs, whole epochs above."""
    return f"{epochs:.2f}" if epochs < 10 else f"{epochs:,.0f}"


@dataclass(frozen=True)
class DataPlan:
    """What a comparison's budgets take from its training data.

    Example:
        ```python
        >>> plan = DataPlan(blocks=192, batch_size=8, budgets=(5, 10, 20, 40, 80), allowed=True)
        >>> plan.needed, plan.fresh_steps, round(plan.epochs(80), 2)
        (640, 24, 3.33)
        ```
    """

    blocks: int
    batch_size: int
    budgets: tuple[int, ...]
    allowed: bool = False

    @property
    def needed(self) -> int:
        """Training blocks the largest budget consumes."""
        return max(self.budgets) * self.batch_size

    @property
    def fresh_steps(self) -> int:
        """Steps whose blocks are all new: one pass over the training data."""
        return self.blocks // self.batch_size

    @property
    def repeats(self) -> bool:
        return self.needed > self.blocks

    def epochs(self, steps: int) -> float:
        """Passes over the training data that `steps` optimizer steps make."""
        return steps * self.batch_size / self.blocks

    def _epochs_text(self) -> str:
        return ", ".join(f"{b} steps {format_epochs(self.epochs(b))}" for b in self.budgets)

    def refusal(self) -> str:
        """The one line that refuses a comparison whose largest budget repeats training blocks."""
        return (f"the training data is shorter than the largest budget: {max(self.budgets)} steps x {self.batch_size} examples "
                f"need {self.needed:,} training blocks, but there are {self.blocks:,} ({format_epochs(self.epochs(max(self.budgets)))} "
                f"epochs: blocks would repeat from step {self.fresh_steps + 1} on); give more training data or smaller budgets, "
                "or allow repetition (--allow-repeated-data, allow_repeated_data=True)")

    def warning(self) -> str:
        """The line a comparison that was allowed to repeat blocks prints before it trains."""
        return (f"training blocks repeat (allow_repeated_data): the largest budget needs {self.needed:,} blocks, there are "
                f"{self.blocks:,}, so blocks repeat from step {self.fresh_steps + 1} on; epochs per budget: {self._epochs_text()}")

    def markdown(self) -> str:
        """One sentence for compare.md: blocks, epochs per budget, and whether (and from where) blocks repeat."""
        head = f"{self.blocks:,} training blocks, {self.batch_size} per step; epochs per budget: {self._epochs_text()}"
        if not self.repeats:
            return f"{head}. Every step draws new blocks (the largest budget uses {self.needed:,} of them)."
        return (f"{head}. Blocks repeat from step {self.fresh_steps + 1} on (allowed by --allow-repeated-data): a budget "
                "past it is epochs of the same text, not fresh data.")

    def to_dict(self) -> dict:
        return {"train_blocks": self.blocks, "batch_size": self.batch_size, "blocks_needed": self.needed,
                "fresh_steps": self.fresh_steps, "repeats": self.repeats, "allow_repeated_data": self.allowed,
                "epochs": {str(b): self.epochs(b) for b in self.budgets}}


def data_plan(cfg, num_blocks: int) -> DataPlan:
    """The `DataPlan` of a `CompareConfig` on `num_blocks` training rows; refuses repetition unless the config allows it.

    Raises:
        ValueError: the largest budget needs more training blocks than there are, and `cfg.allow_repeated_data` is off.
    """
    plan = DataPlan(blocks=int(num_blocks), batch_size=cfg.batch_size, budgets=tuple(cfg.sweep), allowed=cfg.allow_repeated_data)
    if plan.repeats and not plan.allowed:
        raise ValueError(plan.refusal())
    return plan
