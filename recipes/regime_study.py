"""Regime study (issue 33): a miniature of LLaMA Pro's regime. A plateaued base, continued on a new domain up to 100+
tokens per trainable parameter, growth against every control.

    python recipes/regime_study.py --config recipes/configs/regime_study/default.yaml

Smoke size (CI, checks the plumbing, not the science): `python recipes/regime_study.py --smoke --output-dir DIR`
(`--smoke` is `--config recipes/configs/regime_study/smoke.yaml`; flags still override).

1. **A plateaued base, reproducibly.** A character vocabulary (`tokenizers`) read from a seeded sample of the
   Python docs (Debian `python3.11-doc`); a Llama of `hidden_size` x `num_layers` trained from scratch on those
   docs (AdamW, linear warm-up then a constant rate, seeded order) until its held-out loss is flat: every
   held-out loss in the last `plateau_window` of the steps lies within `plateau_tolerance` of the last one
   (checked at each evaluation from `base_min_steps` on; `base_max_steps` caps it, and the study says so if
   the cap was hit). The docs' pages are split three ways, disjoint: base training, the base's held-out set,
   and the retention set forgetting is measured on later (pages the base never saw). Saved as a vanilla
   checkpoint with its tokenizer in `<output_dir>/base` (`from_pretrained` loads it), with `settings.json`;
   a rerun with the same settings reuses it.
2. **Continued on Shakespeare** with `compare_plans` at `budgets` (warmup-stable-decay, one trial per arm and
   rate scored at every budget), growth arms against `layers`, `lora`, `lora:R` and `full`, a learning-rate
   grid per arm kind with the x3 extension rule, `max_forgetting`, once per seed in `seeds` (the data order).
   Trials are stored in `<output_dir>-trials` (a sibling folder): a rerun trains only what is missing.
3. **Summary**: `<output_dir>/study.json` and `study.md` (per seed the verdicts, the per-budget frontier, the
   crossover and its validation; the seeds' spread next to the intervals), each seed's `compare.*` in `seed<S>/`.
   The plateau check, the tokens-per-parameter figure and the seeds are printed.

Cost, measured (2026-12-05) on the shared 2-core CPU while other work loaded it (load average 9.4 at the start,
7.5 at the end), one thread:
    OMP_NUM_THREADS=1 python recipes/regime_study.py --config recipes/configs/regime_study/default.yaml --base-only
- base of default.yaml (205,888 parameters, 120 characters, 40,000 training blocks, 16 x 128 tokens per step):
  4000 steps (8.2M tokens) in 1890 s of wall time, 598 s user + 7 s system CPU; held-out loss 4.757 -> 1.2399;
  "held-out losses from step 3200 to 4000 (9 evaluations) lie within 1.85% of the last (1.2399); drop over the
  window 1.63%; tolerance 1.00%: NOT flat; the cap (base_max_steps=4000) was hit before the curve was flat".
  So at these settings the base does NOT reach the plateau within the cap: about 10 CPU minutes buys 4000
  steps, and the curve still falls ~0.4% per 100 steps at the end. A plateaued base needs a larger cap (more
  than the issue's 10 minutes) or other base settings; not tried yet.
- tokens per trainable parameter of the one-block arm (49,536 parameters): 3.1, 6.3, 12.6, 25.1, 50.3, 100.5 at
  budgets 76..2432 (32x).
- `--smoke`: 28 s user + 1 s system CPU (88 s of wall time under load average ~6).
The whole study (7 arms x 2 rates x 2 seeds, each trial 2432 steps plus the decays of the smaller budgets, about
2900 steps at ~0.15 CPU s each) was not run: about 3 CPU hours (more if grids extend), far above the issue's
60 minutes at these sizes.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SMOKE_CONFIG = REPO / "recipes" / "configs" / "regime_study" / "smoke.yaml"
SPECIALS = ("<pad>", "<eos>", "<unk>")


class BaseMismatchError(ValueError):
    """The output folder holds a base trained with other settings (it is never overwritten)."""


@dataclass
class RegimeStudyConfig:
    """Settings of the regime study, grouped: the base (vocabulary, model, data, training, plateau check) and the
    continued training (Shakespeare, budgets, arms, grids, seeds). Loaded from YAML by `hf_depthgrow.config`."""

    output_dir: str = field(default="runs/regime_study", metadata={"help": "Study folder (base/, seed<S>/, study.json, study.md)."})
    seed: int = field(default=0, metadata={"help": "Seeds the base: page split, vocabulary sample, init, data order; and the Shakespeare split."})
    docs_chars: int | None = field(default=None, metadata={"help": "Characters of the Python docs read, pages in path order (None: all, ~9.4M)."})
    # vocabulary and base model
    vocab_sample_chars: int = field(default=2_000_000, metadata={"help": "Characters of base-training docs the alphabet is read from."})
    min_char_count: int = field(default=2, metadata={"help": "A character seen fewer times in the sample maps to <unk>."})
    hidden_size: int = field(default=64, metadata={"help": "Model width."})
    num_layers: int = field(default=4, metadata={"help": "Layers of the base."})
    num_heads: int = field(default=4, metadata={"help": "Attention heads."})
    intermediate_size: int = field(default=172, metadata={"help": "MLP width (172 ~ 8/3 x 64, Llama's ratio)."})
    block_size: int = field(default=128, metadata={"help": "Tokens (characters) per example."})
    # base data and training
    retention_page_fraction: float = field(default=0.1, metadata={"help": "Share of the docs' pages kept for the retention set only."})
    base_heldout_page_fraction: float = field(default=0.05, metadata={"help": "Share of the pages for the base's held-out set."})
    base_train_blocks: int = field(default=40_000, metadata={"help": "Base training blocks (from the base-training pages)."})
    base_heldout_blocks: int = field(default=128, metadata={"help": "Held-out blocks the plateau is checked on."})
    retention_blocks: int = field(default=256, metadata={"help": "Retention blocks (pages the base never saw)."})
    base_batch_size: int = field(default=16, metadata={"help": "Base examples per step."})
    base_learning_rate: float = field(default=3e-3, metadata={"help": "Base AdamW rate (constant after warm-up)."})
    base_warmup_steps: int = field(default=100, metadata={"help": "Base linear warm-up steps."})
    base_min_steps: int = field(default=1000, metadata={"help": "No plateau check before this step."})
    base_max_steps: int = field(default=4000, metadata={"help": "The cap: base training stops here, flat or not (and says so)."})
    base_eval_every: int = field(default=100, metadata={"help": "Held-out evaluation every N base steps."})
    plateau_tolerance: float = field(default=0.01, metadata={"help": "Flat: held-out losses of the window within this share of the last."})
    plateau_window: float = field(default=0.2, metadata={"help": "The window: this last share of the steps."})
    base_only: bool = field(default=False, metadata={"help": "Stop after the base (train or reuse it, print the plateau check)."})
    # continued training (compare_plans)
    shakespeare_chars: int | None = field(default=None, metadata={"help": "Characters of Shakespeare read (None: all, ~5M)."})
    heldout_blocks: int = field(default=256, metadata={"help": "Shakespeare blocks that choose each arm's rate."})
    test_blocks: int = field(default=512, metadata={"help": "Shakespeare blocks every arm is scored on."})
    budgets: list[int] = field(default_factory=lambda: [76, 152, 304, 608, 1216, 2432], metadata={"help": "Steps; span >= 32x."})
    batch_size: int = field(default=16, metadata={"help": "Examples per step of every arm."})
    growth: list[str] = field(default_factory=lambda: ["top:1", "probe:1", "interleave:2"], metadata={"help": "Growth arms."})
    controls: list[str] = field(default_factory=lambda: ["layers", "lora", "lora:2", "full"], metadata={"help": "Control arms."})
    reference: str | None = field(default="top:1", metadata={"help": "The growth arm the controls match (the one-block arm)."})
    growth_learning_rates: list[float] = field(default_factory=lambda: [3e-3, 1e-2], metadata={"help": "Growth arms' grid."})
    lora_learning_rates: list[float] = field(default_factory=lambda: [3e-3, 1e-2], metadata={"help": "LoRA controls' grid."})
    layers_learning_rates: list[float] = field(default_factory=lambda: [1e-3, 3e-3], metadata={"help": "Layers control's grid."})
    full_learning_rates: list[float] = field(default_factory=lambda: [3e-4, 1e-3], metadata={"help": "Full control's grid."})
    lr_extensions: int = field(default=1, metadata={"help": "x3 rates an arm's grid may gain when its choice is at an edge."})
    max_forgetting: float = field(default=0.05, metadata={"help": "Forgetting budget EPS in nats (retention loss rise)."})
    seeds: list[int] = field(default_factory=lambda: [0, 1], metadata={"help": "Data orders of the continued training (>= 2)."})
    n_bootstrap: int = field(default=1000, metadata={"help": "Paired bootstrap resamples (the curve fits use at most 500)."})
    selection_max_examples: int = field(default=64, metadata={"help": "Training examples the fallback rule compares on."})
    progress: bool = field(default=True, metadata={"help": "Progress bars."})

    def __post_init__(self):
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size", "block_size", "vocab_sample_chars",
                     "base_train_blocks", "base_heldout_blocks", "retention_blocks", "base_batch_size", "base_min_steps",
                     "base_max_steps", "base_eval_every", "heldout_blocks", "test_blocks", "batch_size", "min_char_count"):  # fmt: skip
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
        if len(self.seeds) < 2 or len(set(self.seeds)) != len(self.seeds) or any(s < 0 for s in self.seeds):
            raise ValueError(f"seeds must be at least 2 distinct ints >= 0 (the seed spread), got {self.seeds!r}")
        self.compare_config(self.seeds[0])  # CompareConfig checks arms, grids and budgets now, before anything trains

    def compare_config(self, seed: int):
        """The `CompareConfig` of one seed of the continued training."""
        from hf_depthgrow.comparison import CompareConfig

        grids = {f"{k}_learning_rates": getattr(self, f"{k}_learning_rates") for k in ("growth", "lora", "layers", "full")}
        return CompareConfig(growth=list(self.growth), controls=list(self.controls), reference=self.reference, budgets=list(self.budgets),
                             batch_size=self.batch_size, lr_extensions=self.lr_extensions, max_forgetting=self.max_forgetting,
                             seed=seed, n_bootstrap=self.n_bootstrap, progress=self.progress,
                             selection_max_examples=self.selection_max_examples, **grids)  # fmt: skip

    def base_settings(self) -> dict:
        """What the base depends on: a saved base is reused only when these match."""
        keys = ("seed", "docs_chars", "vocab_sample_chars", "min_char_count", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                "block_size", "retention_page_fraction", "base_heldout_page_fraction", "base_train_blocks", "base_heldout_blocks",
                "base_batch_size", "base_learning_rate", "base_warmup_steps", "base_min_steps", "base_max_steps",
                "base_eval_every", "plateau_tolerance", "plateau_window")  # fmt: skip
        return {k: getattr(self, k) for k in keys}


# ------------------------------------------------------------------------------------------------------------------
# The plateau check
# ------------------------------------------------------------------------------------------------------------------


def plateau_check(curve: list[tuple[int, float]], *, tolerance: float = 0.01, window: float = 0.2) -> dict:
    """Is a held-out curve flat: every loss evaluated in the last `window` of the steps within `tolerance` of the last?

    Args:
        curve: `(step, held-out loss)` pairs in step order, the last at the final step.
        tolerance: The largest relative deviation `|L_i - L_last| / L_last` allowed in the window.
        window: The window's share of the final step (steps >= `(1 - window) * final`).

    Returns:
        `{"flat", "window_start", "points", "last", "max_deviation", "first_in_window", "drop", "text"}`; with fewer
        than 3 evaluations in the window it is not flat (too few to say).

    Example:
        ```python
        >>> plateau_check([(0, 4.0), (80, 2.02), (90, 2.01), (100, 2.0)])["flat"]
        True
        ```
    """
    if not curve:
        raise ValueError("the held-out curve is empty")
    final = curve[-1][0]
    start = (1 - window) * final
    points = [(s, v) for s, v in curve if s >= start]
    last = points[-1][1]
    deviation = max(abs(v - last) for _, v in points) / abs(last)
    drop = (points[0][1] - last) / abs(last)
    flat = len(points) >= 3 and deviation <= tolerance
    why = "" if len(points) >= 3 else f" (only {len(points)} evaluations in the window: too few to say)"
    text = (f"plateau check: held-out losses from step {points[0][0]} to {final} ({len(points)} evaluations, the last "
            f"{window:.0%} of the steps) lie within {deviation:.2%} of the last ({last:.4f}); drop over the window "
            f"{drop:.2%}; tolerance {tolerance:.2%}: {'FLAT' if flat else 'NOT flat'}{why}")  # fmt: skip
    return {"flat": flat, "window_start": points[0][0], "points": len(points), "last": last, "max_deviation": deviation,
            "first_in_window": points[0][1], "drop": drop, "tolerance": tolerance, "window": window, "text": text}  # fmt: skip


# ------------------------------------------------------------------------------------------------------------------
# Vocabulary, data, base model
# ------------------------------------------------------------------------------------------------------------------


def char_tokenizer(texts: list[str], min_count: int):
    """A character-level `PreTrainedTokenizerFast` (`tokenizers` BPE with no merges): every character seen
    `min_count` times in `texts`, in sorted order, after `<pad>`, `<eos>`, `<unk>`; others map to `<unk>`."""
    from collections import Counter

    import transformers
    from tokenizers import Tokenizer, decoders, models

    counts = Counter()
    for text in texts:
        counts.update(text)
    alphabet = sorted(c for c, n in counts.items() if n >= min_count and c not in SPECIALS)
    vocab = {tok: i for i, tok in enumerate([*SPECIALS, *alphabet])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def page_split(num_pages: int, cfg: RegimeStudyConfig) -> dict[str, list[int]]:
    """Disjoint page indices: `retention` (never seen by the base), `base_heldout`, `base_train` (seeded)."""
    import numpy as np

    order = np.random.default_rng(cfg.seed).permutation(num_pages).tolist()
    n_ret = max(1, round(cfg.retention_page_fraction * num_pages))
    n_held = max(1, round(cfg.base_heldout_page_fraction * num_pages))
    return {"retention": sorted(order[:n_ret]), "base_heldout": sorted(order[n_ret:n_ret + n_held]),
            "base_train": sorted(order[n_ret + n_held:])}  # fmt: skip


def block_rows(tokenizer, texts: list[str], block_size: int, max_blocks: int | None) -> list[dict]:
    """Causal-LM rows (`input_ids`, `attention_mask`, `labels`) of consecutive blocks of `texts`."""
    import torch

    from hf_depthgrow.data import causal_lm_blocks

    blocks = causal_lm_blocks(tokenizer, texts, block_size, max_blocks=max_blocks)
    ones = torch.ones(block_size, dtype=torch.long)
    return [{"input_ids": b, "attention_mask": ones, "labels": b} for b in blocks]


def build_base(cfg: RegimeStudyConfig, vocab_size: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                         num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
                         max_position_embeddings=cfg.block_size, tie_word_embeddings=True, bos_token_id=None, eos_token_id=1,
                         pad_token_id=0)  # fmt: skip
    return LlamaForCausalLM(config)


def heldout_loss(model, rows: list[dict], batch_size: int = 64) -> float:
    """Token-weighted mean loss of `model` on `rows`."""
    import torch

    from hf_depthgrow.losses import batch_example_losses

    total = weight = 0.0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(rows), batch_size):
            chunk = rows[i:i + batch_size]
            batch = {k: torch.stack([r[k] for r in chunk]) for k in chunk[0]}
            losses = batch_example_losses(model, batch)
            total += float((losses.per_example.double() * losses.weight.double()).sum())
            weight += float(losses.weight.double().sum())
    model.train()
    return total / weight


def train_base(model, train_rows: list[dict], heldout_rows: list[dict], cfg: RegimeStudyConfig, log=print) -> dict:
    """AdamW with linear warm-up then a constant rate, until `plateau_check` says flat (from `base_min_steps`) or the cap."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.base_learning_rate, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(cfg.base_warmup_steps, 1)))
    gen = torch.Generator().manual_seed(cfg.seed)
    order, cursor = torch.randperm(len(train_rows), generator=gen), 0
    curve, check, started = [(0, heldout_loss(model, heldout_rows))], None, time.perf_counter()
    model.train()
    for step in range(1, cfg.base_max_steps + 1):
        if cursor + cfg.base_batch_size > len(order):  # a new epoch, a new seeded order
            order, cursor = torch.randperm(len(train_rows), generator=gen), 0
        idx = order[cursor:cursor + cfg.base_batch_size].tolist()
        cursor += cfg.base_batch_size
        batch = {k: torch.stack([train_rows[i][k] for i in idx]) for k in ("input_ids", "labels")}
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % cfg.base_eval_every and step != cfg.base_max_steps:
            continue
        curve.append((step, heldout_loss(model, heldout_rows)))
        log(f"base step {step}: train {loss.item():.4f}, held-out {curve[-1][1]:.4f} ({time.perf_counter() - started:.0f} s)")
        if step >= cfg.base_min_steps:
            check = plateau_check(curve, tolerance=cfg.plateau_tolerance, window=cfg.plateau_window)
            if check["flat"]:
                break
    seconds = time.perf_counter() - started
    check = check or plateau_check(curve, tolerance=cfg.plateau_tolerance, window=cfg.plateau_window)
    cap = not check["flat"] and curve[-1][0] >= cfg.base_max_steps
    check["cap_hit"] = cap
    if cap:
        check["text"] += f"; the cap (base_max_steps={cfg.base_max_steps}) was hit before the curve was flat"
    return {"curve": curve, "plateau": check, "steps": curve[-1][0], "seconds": seconds,
            "tokens": curve[-1][0] * cfg.base_batch_size * cfg.block_size}  # fmt: skip


def prepare_base(cfg: RegimeStudyConfig, log=print):
    """`(model, tokenizer, retention_rows, base_info)`: the saved base when its settings match, else a new one, trained and saved."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from hf_depthgrow.data import python_docs_texts

    pages = python_docs_texts(max_chars=cfg.docs_chars)
    split = page_split(len(pages), cfg)
    assert not (set(split["retention"]) & (set(split["base_train"]) | set(split["base_heldout"])))  # by construction
    text = lambda part: [pages[i] for i in split[part]]  # noqa: E731
    folder = Path(cfg.output_dir) / "base"
    info_path = folder / "settings.json"
    if folder.exists() and not info_path.is_file():
        raise BaseMismatchError(f"{folder} exists and is not a regime-study base (no settings.json): use another output_dir")
    if info_path.is_file():
        info = json.loads(info_path.read_text())
        if info.get("settings") != cfg.base_settings():
            changed = sorted(k for k in cfg.base_settings() if (info.get("settings") or {}).get(k) != getattr(cfg, k))
            raise BaseMismatchError(f"{folder} holds a base trained with other settings ({', '.join(changed)}): use another output_dir")
        log(f"reusing the base in {folder} (same settings)")
        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False)
    else:
        train_texts = text("base_train")
        tokenizer = char_tokenizer(_sample(train_texts, cfg.vocab_sample_chars, cfg.seed), cfg.min_char_count)
        model = build_base(cfg, len(tokenizer))
        train_rows = block_rows(tokenizer, train_texts, cfg.block_size, cfg.base_train_blocks)
        held_rows = block_rows(tokenizer, text("base_heldout"), cfg.block_size, cfg.base_heldout_blocks)
        log(f"base: {sum(p.numel() for p in model.parameters()):,} parameters, vocabulary {len(tokenizer)}, "
            f"{len(train_rows)} training blocks, {len(held_rows)} held-out blocks of {cfg.block_size} characters")
        info = {"settings": cfg.base_settings(), **train_base(model, train_rows, held_rows, cfg, log=log)}
        info.update(vocab_size=len(tokenizer), pages={k: len(v) for k, v in split.items()}, train_blocks=len(train_rows))
        _save_base(model, tokenizer, info, folder)
    retention = block_rows(tokenizer, text("retention"), cfg.block_size, cfg.retention_blocks)
    return model.eval(), tokenizer, retention, info


def _sample(texts: list[str], chars: int, seed: int) -> list[str]:
    import numpy as np

    out, left = [], chars
    for i in np.random.default_rng(seed).permutation(len(texts)):
        if left <= 0:
            break
        out.append(texts[i][:left])
        left -= len(out[-1])
    return out


def _save_base(model, tokenizer, info: dict, folder: Path) -> None:
    """Model, tokenizer and settings.json into a temp folder beside `folder`, then one rename (never half a base)."""
    from hf_depthgrow.utils import umask, write_json

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".base."))
    try:
        os.chmod(tmp, 0o777 & ~umask())  # mkdtemp's 0700 would stay on the base folder
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        write_json(tmp / "settings.json", info)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def shakespeare_rows(cfg: RegimeStudyConfig, tokenizer) -> tuple[list[dict], list[dict], list[dict]]:
    """`(train, held-out, test)` blocks of Shakespeare in the base's vocabulary (a seeded split of blocks)."""
    import numpy as np

    from hf_depthgrow.data import shakespeare_texts

    rows = block_rows(tokenizer, shakespeare_texts(max_chars=cfg.shakespeare_chars), cfg.block_size, None)
    need = cfg.heldout_blocks + cfg.test_blocks + cfg.batch_size
    if len(rows) < need:
        raise ValueError(f"Shakespeare gives {len(rows)} blocks of {cfg.block_size}; held-out + test + one batch need {need}")
    order = np.random.default_rng(cfg.seed).permutation(len(rows))
    held, test = order[:cfg.heldout_blocks], order[cfg.heldout_blocks:cfg.heldout_blocks + cfg.test_blocks]
    train = np.sort(order[cfg.heldout_blocks + cfg.test_blocks:])
    return [rows[i] for i in train], [rows[i] for i in held], [rows[i] for i in test]


def regime_figures(cfg: RegimeStudyConfig, model) -> dict:
    """The one-block arm's trainable parameters (a copy of one layer) and tokens per parameter at each budget."""
    layer = model.model.layers[0]
    block = sum(p.numel() for p in layer.parameters())
    tokens = [b * cfg.batch_size * cfg.block_size for b in cfg.budgets]
    return {"block_parameters": block, "tokens": tokens, "tokens_per_parameter": [t / block for t in tokens],
            "span": cfg.budgets[-1] / cfg.budgets[0]}  # fmt: skip


# ------------------------------------------------------------------------------------------------------------------
# Summary
# ------------------------------------------------------------------------------------------------------------------


def _interval(row: dict | None) -> str:
    return f"{row['mean']:+.4f} [{row['low']:+.4f}, {row['high']:+.4f}]" if row else ""


def summarize(results: dict, base: dict, figures: dict) -> dict:
    """Per seed the verdicts, the per-budget frontier, the crossover and its validation; per budget and arm the seeds'
    gains and forgetting with their intervals and spread (max - min of the seeds' means)."""
    seeds = {s: r.sweep_dict()["budgets"] for s, r in results.items()}  # each budget's rows, JSON-ready
    per_seed = {}
    for s, r in results.items():
        curves = r.curves or {}
        per_seed[s] = {"verdict": r.verdict, "budgets": [{"steps": v["steps"], "tokens": v["tokens"], "frontier": v["frontier"],
                       "best_within": (v["frontier_detail"] or {}).get("best_within"), "verdict": v["verdict"]} for v in seeds[s]],
                       "crossover": curves.get("crossover_text"), "within_forgetting": curves.get("within_text"),
                       "validation": curves.get("validation_text"), "best_control": r.statistics.get("best_control"),
                       "best_growth": r.statistics.get("best_growth")}  # fmt: skip
    first = next(iter(seeds.values()))
    table = []
    for i, view in enumerate(first):
        for arm, row in view["arms"].items():
            if row["kind"] == "original":
                continue
            rows = {s: seeds[s][i]["arms"][arm] for s in seeds}
            gains = [r["gain"]["mean"] for r in rows.values()]
            forget = [r["forgetting"]["mean"] for r in rows.values() if r["forgetting"]]
            table.append({"steps": view["steps"], "arm": arm, "kind": row["kind"], "tokens_per_parameter": row["tokens_per_parameter"],
                          "gain": {s: r["gain"] for s, r in rows.items()}, "gain_spread": max(gains) - min(gains),
                          "forgetting": {s: r["forgetting"] for s, r in rows.items()},
                          "forgetting_spread": (max(forget) - min(forget)) if forget else None,
                          "on_frontier": [s for s in seeds if arm in (seeds[s][i]["frontier"] or [])]})  # fmt: skip
    return {"seeds": list(results), "base": {k: v for k, v in base.items() if k != "curve"}, "base_curve": base.get("curve"),
            "regime": figures, "per_seed": per_seed, "table": table}  # fmt: skip


def summary_markdown(summary: dict) -> str:
    base, fig, seeds = summary["base"], summary["regime"], summary["seeds"]
    lines = ["# Regime study: a plateaued base continued on Shakespeare", "",
             f"- Base: {base.get('steps')} steps, {base.get('tokens', 0):,} tokens, {base.get('seconds', 0):.0f} s. "
             f"{base['plateau']['text']}.",
             f"- One-block growth arm: {fig['block_parameters']:,} trainable parameters; tokens per trainable parameter at the "
             f"budgets: {', '.join(f'{x:.1f}' for x in fig['tokens_per_parameter'])} (budgets span {fig['span']:g}x).",
             f"- Seeds (data order): {seeds}.", "", "## Verdicts", ""]  # fmt: skip
    lines += [f"- seed {s}: {p['verdict']}." for s, p in summary["per_seed"].items()]
    head = " | ".join(f"gain s{s}" for s in seeds) + " | gain spread | " + " | ".join(f"forgetting s{s}" for s in seeds)
    lines += ["", "## Per budget, every seed", "", "gain = paired test delta vs the original (nats, positive = better), forgetting = "
              "retention loss rise (positive = forgot), each with its corrected interval; spread = max - min of the seeds' means; "
              "F = on the gain x forgetting frontier in these seeds.", "",
              f"| steps | arm | tok/param | {head} | forgetting spread | F |", "|---" * (6 + 2 * len(seeds)) + "|"]  # fmt: skip
    for row in summary["table"]:
        gains = " | ".join(_interval(row["gain"][s]) for s in seeds)
        forget = " | ".join(_interval(row["forgetting"][s]) for s in seeds)
        spread = "" if row["forgetting_spread"] is None else f"{row['forgetting_spread']:.4f}"
        tpp = "" if row["tokens_per_parameter"] is None else f"{row['tokens_per_parameter']:.1f}"
        lines.append(f"| {row['steps']} | {row['arm']} | {tpp} | {gains} | {row['gain_spread']:.4f} | {forget} | {spread} | "
                     f"{','.join(str(s) for s in row['on_frontier'])} |")
    lines += ["", "## Frontier per budget", ""]
    for s, p in summary["per_seed"].items():
        lines += [f"- seed {s}, {b['steps']} steps: frontier {b['frontier']}; within the forgetting budget: {b['best_within']}."
                  for b in p["budgets"]]
    lines += ["", "## Crossover and its validation", ""]
    for s, p in summary["per_seed"].items():
        lines += [f"- seed {s}: {text}" for text in (p["crossover"], p["within_forgetting"], p["validation"]) if text]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------------------------


def run(cfg: RegimeStudyConfig, log=print) -> dict | None:
    """Base (trained or reused), then `compare_plans` per seed, then the summary; returns it (`None` with `base_only`)."""
    from hf_depthgrow.comparison import compare_plans
    from hf_depthgrow.utils import atomic_write_text, write_json

    out = Path(cfg.output_dir)
    log(f"seeds (data order of the continued training): {cfg.seeds}")
    model, tokenizer, retention, base = prepare_base(cfg, log=log)
    log(base["plateau"]["text"])
    figures = regime_figures(cfg, model)
    log(f"tokens per trainable parameter of the one-block growth arm ({figures['block_parameters']:,} parameters): "
        + ", ".join(f"{b} steps: {x:.1f}" for b, x in zip(cfg.budgets, figures["tokens_per_parameter"]))
        + f"; the largest {'>=' if figures['tokens_per_parameter'][-1] >= 100 else 'BELOW'} 100; budgets span {figures['span']:g}x")
    if cfg.base_only:
        return None
    train, held, test = shakespeare_rows(cfg, tokenizer)
    log(f"Shakespeare: {len(train)} training, {len(held)} held-out, {len(test)} test blocks; retention: {len(retention)} "
        "blocks of Python docs pages the base never saw")
    trials = out.with_name(out.name + "-trials")
    results = {}
    for seed in cfg.seeds:
        result = compare_plans(model, train, held, test, config=cfg.compare_config(seed), retention_data=retention, trials_dir=trials)
        result.save(out / f"seed{seed}")
        log(f"seed {seed}: {result.verdict}")
        results[seed] = result
    summary = summarize(results, base, figures)
    write_json(out / "study.json", summary)
    atomic_write_text(out / "study.md", summary_markdown(summary))
    log(f"summary: {out / 'study.md'}")
    return summary


def main(argv: list[str] | None = None) -> int:
    from hf_depthgrow.config import parse_args

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--smoke" in argv:
        if "--config" in argv:
            print("error: --smoke is --config recipes/configs/regime_study/smoke.yaml: give one of them", file=sys.stderr)
            return 2
        argv = ["--config", str(SMOKE_CONFIG)] + [a for a in argv if a != "--smoke"]
    try:
        (cfg,) = parse_args(RegimeStudyConfig, argv=argv, prog="recipes/regime_study.py", description=__doc__.split("\n")[0])
    except (ValueError, FileNotFoundError) as err:  # ConfigError is a ValueError; one line, nothing written
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        run(cfg)
    except BaseMismatchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
