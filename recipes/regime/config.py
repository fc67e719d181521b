"""The regime study's settings (`RegimeStudyConfig`), loaded from YAML by `hf_depthgrow.config.parse_args`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

ORACLE_PREDICTORS = ("z", "signal", "lookahead", "block_influence", "depth", "adept", "midas")


@dataclass
class RegimeStudyConfig:
    """Settings of the regime study, grouped: the base (vocabulary, model, data, training, plateau check) and the
    continued training (Shakespeare, budgets, arms, grids, seeds). Loaded from YAML by `hf_depthgrow.config`."""

    output_dir: str = field(default="runs/regime_study", metadata={"help": "Study folder (base/, seed<S>/, study.json, study.md)."})
    resume: bool = field(default=False, metadata={"help": "Continue the study in output_dir (its base and stored trials are reused)."})
    overwrite: bool = field(default=False, metadata={"help": "Replace what an earlier study wrote in output_dir (never a user's own files)."})
    seed: int = field(default=0, metadata={"help": "Seeds the base: page split, vocabulary sample, init, data order; and the Shakespeare split."})
    docs_chars: int | None = field(default=None, metadata={"help": "Characters of the Python docs read, pages in path order (None: all, ~9.4M)."})
    # vocabulary and base model
    vocab_sample_chars: int = field(default=2_000_000, metadata={"help": "Characters of base-training docs the alphabet is read from."})
    min_char_count: int = field(default=2, metadata={"help": "A character seen fewer times in the sample maps to <unk>."})
    hidden_size: int = field(default=32, metadata={"help": "Model width."})
    num_layers: int = field(default=4, metadata={"help": "Layers of the base."})
    num_heads: int = field(default=4, metadata={"help": "Attention heads."})
    intermediate_size: int = field(default=86, metadata={"help": "MLP width (86 ~ 8/3 x 32, Llama's ratio)."})
    block_size: int = field(default=128, metadata={"help": "Tokens (characters) per example."})
    # base data and training
    retention_page_fraction: float = field(default=0.1, metadata={"help": "Share of the docs' pages kept for the retention set only."})
    base_heldout_page_fraction: float = field(default=0.05, metadata={"help": "Share of the pages for the base's held-out set."})
    base_train_blocks: int = field(default=60_000, metadata={"help": "Base training blocks (from the base-training pages)."})
    base_heldout_blocks: int = field(default=128, metadata={"help": "Held-out blocks the plateau is checked on."})
    retention_blocks: int = field(default=256, metadata={"help": "Retention blocks (pages the base never saw)."})
    retention_per_page: int = field(default=3, metadata={"help": "Retention blocks sampled from each retention page (documents are the bootstrap's unit)."})
    base_batch_size: int = field(default=32, metadata={"help": "Base examples per step."})
    base_learning_rate: float = field(default=1e-2, metadata={"help": "Base AdamW rate (constant after warm-up)."})
    base_warmup_steps: int = field(default=100, metadata={"help": "Base linear warm-up steps."})
    base_min_steps: int = field(default=1000, metadata={"help": "No plateau check before this step (with base_decay_steps: where the decay starts)."})
    base_decay_steps: int = field(default=0, metadata={"help": "Linear decay of the rate from base_min_steps over this many steps to base_final_learning_rate, "
                                                               "then constant; the plateau window must lie wholly after it (0: constant throughout)."})
    base_final_learning_rate: float | None = field(default=None, metadata={"help": "The rate after the decay (None: no decay)."})
    base_max_steps: int = field(default=3600, metadata={"help": "The cap: base training stops here, flat or not (and says so)."})
    base_eval_every: int = field(default=50, metadata={"help": "Held-out evaluation every N base steps."})
    plateau_tolerance: float = field(default=0.01, metadata={"help": "Flat: held-out losses of the window within this share of the last."})
    plateau_window: float = field(default=0.2, metadata={"help": "The window: this last share of the steps."})
    base_only: bool = field(default=False, metadata={"help": "Stop after the base (train or reuse it, print the plateau check)."})
    # continued training (compare_plans)
    shakespeare_chars: int | None = field(default=None, metadata={"help": "Characters of Shakespeare read (None: all, ~5M)."})
    heldout_blocks: int = field(default=256, metadata={"help": "Shakespeare blocks that choose each arm's rate."})
    test_blocks: int = field(default=512, metadata={"help": "Shakespeare blocks every arm is scored on."})
    budgets: list[int] = field(default_factory=lambda: [19, 38, 76, 152, 304, 608], metadata={"help": "Steps; span >= 32x."})
    batch_size: int = field(default=16, metadata={"help": "Examples per step of every arm."})
    growth: list[str] = field(default_factory=lambda: ["top:1", "probe:1", "interleave:2"], metadata={"help": "Growth arms."})
    controls: list[str] = field(default_factory=lambda: ["layers", "lora", "full"], metadata={"help": "Control arms."})
    reference: str | None = field(default="top:1", metadata={"help": "The growth arm the controls match (the one-block arm)."})
    growth_learning_rates: list[float] = field(default_factory=lambda: [3e-3, 1e-2], metadata={"help": "Growth arms' grid."})
    lora_learning_rates: list[float] = field(default_factory=lambda: [3e-3, 1e-2], metadata={"help": "LoRA controls' grid."})
    layers_learning_rates: list[float] = field(default_factory=lambda: [1e-3, 3e-3], metadata={"help": "Layers control's grid."})
    full_learning_rates: list[float] = field(default_factory=lambda: [3e-4, 1e-3], metadata={"help": "Full control's grid."})
    lr_extensions: int = field(default=1, metadata={"help": "x3 rates an arm's grid may gain when its choice is at an edge."})
    max_learning_rate: float = field(default=0.1, metadata={"help": "The largest rate a grid extension may try (the cap)."})
    max_forgetting: float = field(default=0.05, metadata={"help": "Forgetting budget EPS in nats (retention loss rise)."})
    seeds: list[int] = field(default_factory=lambda: [0, 1], metadata={"help": "Data orders of the continued training (>= 2)."})
    n_bootstrap: int = field(default=1000, metadata={"help": "Paired bootstrap resamples (the curve fits use at most 500)."})
    selection_max_examples: int = field(default=64, metadata={"help": "Training examples the fallback rule compares on."})
    progress: bool = field(default=True, metadata={"help": "Progress bars."})
    engine: str = field(default="serial", metadata={"help": "Where trials run: serial, or ray (a local Ray: trials at once).", "choices": ["serial", "ray"]})
    max_concurrent_trials: int | None = field(default=None, metadata={"help": "engine ray: trials at once (None: one per CPU)."})
    # the look-ahead's pick as a growth arm, and the oracle sweep over positions
    lookahead_arm: bool = field(default=True, metadata={"help": "Add the look-ahead's pick (at:k, best of every position) as a growth arm."})
    lookahead_steps: int = field(default=4, metadata={"help": "Optimizer steps per position of the look-ahead (the arm's and the oracle's)."})
    oracle_budgets: list[int] | None = field(default_factory=lambda: [76, 608], metadata={"help": "Two budgets >= 8x apart of the oracle sweep (None: no sweep)."})
    oracle_seeds: list[int] | None = field(default=None, metadata={"help": "Seeds (data orders) of the oracle sweep (None: seeds)."})
    oracle_positions: list[int] | None = field(default=None, metadata={"help": "Oracle positions, an even grid (None: every position 0..L)."})
    oracle_predictors: list[str] = field(default_factory=lambda: list(ORACLE_PREDICTORS), metadata={"help": "Predictors scored by the oracle."})

    def __post_init__(self):
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size", "block_size", "vocab_sample_chars",
                     "base_train_blocks", "base_heldout_blocks", "retention_blocks", "retention_per_page", "base_batch_size", "base_min_steps",
                     "base_max_steps", "base_eval_every", "heldout_blocks", "test_blocks", "batch_size", "min_char_count"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of num_heads ({self.num_heads})")
        if self.base_min_steps > self.base_max_steps:
            raise ValueError(f"base_min_steps ({self.base_min_steps}) exceeds the cap base_max_steps ({self.base_max_steps})")
        if self.base_warmup_steps < 0 or self.base_warmup_steps >= self.base_min_steps:
            raise ValueError(f"base_warmup_steps must be in [0, base_min_steps), got {self.base_warmup_steps!r}")
        for name in ("plateau_tolerance", "plateau_window", "retention_page_fraction", "base_heldout_page_fraction"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < 1:
                raise ValueError(f"{name} must be in (0, 1), got {value!r}")
        if self.retention_page_fraction + self.base_heldout_page_fraction >= 0.5:
            raise ValueError("retention_page_fraction + base_heldout_page_fraction must leave most pages for base training")
        if not (isinstance(self.base_learning_rate, (int, float)) and math.isfinite(self.base_learning_rate) and self.base_learning_rate > 0):
            raise ValueError(f"base_learning_rate must be a finite number > 0, got {self.base_learning_rate!r}")
        if not isinstance(self.base_decay_steps, int) or isinstance(self.base_decay_steps, bool) or self.base_decay_steps < 0:
            raise ValueError(f"base_decay_steps must be an int >= 0, got {self.base_decay_steps!r}")
        final = self.base_final_learning_rate
        if (final is None) != (self.base_decay_steps == 0):
            raise ValueError("base_decay_steps and base_final_learning_rate go together: give both (a decay) or neither")
        if final is not None and not (isinstance(final, (int, float)) and math.isfinite(final) and 0 < final < self.base_learning_rate):
            raise ValueError(f"base_final_learning_rate must be a number in (0, base_learning_rate), got {final!r}")
        if self.base_min_steps + self.base_decay_steps > self.base_max_steps:
            raise ValueError(f"the decay ends at step {self.base_min_steps + self.base_decay_steps}, after the cap base_max_steps ({self.base_max_steps})")
        if len(self.seeds) < 2 or len(set(self.seeds)) != len(self.seeds) or any(s < 0 for s in self.seeds):
            raise ValueError(f"seeds must be at least 2 distinct ints >= 0 (the seed spread), got {self.seeds!r}")
        if self.oracle_budgets is not None:
            b = self.oracle_budgets
            if len(b) != 2 or not all(isinstance(x, int) and x >= 1 for x in b) or b[1] < 8 * b[0]:
                raise ValueError(f"oracle_budgets must be two step counts, the second >= 8x the first, got {b!r}")
            if self.oracle_seeds is not None and (not self.oracle_seeds or len(set(self.oracle_seeds)) != len(self.oracle_seeds)):
                raise ValueError(f"oracle_seeds must be distinct and non-empty (or null: seeds), got {self.oracle_seeds!r}")
            positions = self.oracle_positions if self.oracle_positions is not None else range(self.num_layers + 1)
            if len(set(positions)) < 4 or not all(isinstance(k, int) and 0 <= k <= self.num_layers for k in positions):
                raise ValueError(f"the oracle needs at least 4 distinct positions in 0..num_layers ({self.num_layers}), got {list(positions)}")
        if not isinstance(self.lookahead_steps, int) or isinstance(self.lookahead_steps, bool) or self.lookahead_steps < 1:
            raise ValueError(f"lookahead_steps must be an int >= 1, got {self.lookahead_steps!r}")
        if self.resume and self.overwrite:
            raise ValueError("resume continues the study in output_dir and overwrite replaces it: give one of them")
        self.oracle_config()  # CompareConfig checks arms, grids, budgets and the engine now, before anything trains

    def compare_config(self, seed: int):
        """The `CompareConfig` of one seed of the continued training."""
        from hf_depthgrow.comparison import CompareConfig

        grids = {f"{k}_learning_rates": getattr(self, f"{k}_learning_rates") for k in ("growth", "lora", "layers", "full")}
        return CompareConfig(growth=list(self.growth), controls=list(self.controls), reference=self.reference, budgets=list(self.budgets),
                             batch_size=self.batch_size, lr_extensions=self.lr_extensions, max_learning_rate=self.max_learning_rate,
                             max_forgetting=self.max_forgetting,
                             seed=seed, n_bootstrap=self.n_bootstrap, progress=self.progress,
                             selection_max_examples=self.selection_max_examples, engine=self.engine,
                             max_concurrent_trials=self.max_concurrent_trials, **grids)

    def oracle_config(self):
        """The `CompareConfig` of the oracle sweep: the continued training's, at `oracle_budgets` (the first seed's; the
        oracle's own seeds are the study's)."""
        from dataclasses import replace

        cfg = self.compare_config(self.seeds[0])
        return replace(cfg, budgets=list(self.oracle_budgets)) if self.oracle_budgets is not None else cfg

    def base_settings(self) -> dict:
        """What the base depends on: a saved base is reused only when these match."""
        keys = ("seed", "docs_chars", "vocab_sample_chars", "min_char_count", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                "block_size", "retention_page_fraction", "base_heldout_page_fraction", "base_train_blocks", "base_heldout_blocks",
                "base_batch_size", "base_learning_rate", "base_warmup_steps", "base_min_steps", "base_decay_steps", "base_final_learning_rate", "base_max_steps",
                "base_eval_every", "plateau_tolerance", "plateau_window")
        return {k: getattr(self, k) for k in keys}
