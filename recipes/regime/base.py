"""The regime study's base: a character vocabulary, a small Llama trained from scratch on the Python docs until its
held-out loss is flat (`plateau_check`), saved atomically and reused only with the same settings."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

SPECIALS = ("<pad>", "<eos>", "<unk>")


class BaseMismatchError(ValueError):
    """The output folder holds a base trained with other settings (it is never overwritten)."""


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
            f"{drop:.2%}; tolerance {tolerance:.2%}: {'FLAT' if flat else 'NOT flat'}{why}")
    return {"flat": flat, "window_start": points[0][0], "points": len(points), "last": last, "max_deviation": deviation,
            "first_in_window": points[0][1], "drop": drop, "tolerance": tolerance, "window": window, "text": text}


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


def page_split(num_pages: int, cfg) -> dict[str, list[int]]:
    """Disjoint page indices: `retention` (never seen by the base), `base_heldout`, `base_train` (seeded)."""
    import numpy as np

    order = np.random.default_rng(cfg.seed).permutation(num_pages).tolist()
    n_ret = max(1, round(cfg.retention_page_fraction * num_pages))
    n_held = max(1, round(cfg.base_heldout_page_fraction * num_pages))
    return {"retention": sorted(order[:n_ret]), "base_heldout": sorted(order[n_ret:n_ret + n_held]),
            "base_train": sorted(order[n_ret + n_held:])}


def block_rows(tokenizer, texts: list[str], block_size: int, max_blocks: int | None, documents=None) -> list[dict]:
    """Causal-LM rows (`input_ids`, `attention_mask`, `labels`, `document`) of consecutive blocks of `texts`; a
    block's document is the id (in `documents`, else the position) of the text it starts in."""

    from hf_depthgrow.data import causal_lm_blocks

    blocks, owners = causal_lm_blocks(tokenizer, texts, block_size, max_blocks=max_blocks, with_documents=True)
    names = list(range(len(texts))) if documents is None else list(documents)
    return _rows(blocks, [names[d] for d in owners.tolist()])


def sampled_rows(tokenizer, texts: list[str], block_size: int, max_blocks: int, per_document: int, seed: int, documents) -> list[dict]:
    """Rows of `per_document` blocks from each of many documents (a seeded sample), each with its `document`."""

    from hf_depthgrow.data import sampled_document_blocks

    blocks, owners = sampled_document_blocks(tokenizer, texts, block_size, per_document=per_document, max_blocks=max_blocks,
                                             seed=seed, documents=list(documents))
    return _rows(blocks, owners)


def _rows(blocks, documents) -> list[dict]:
    """Causal-LM rows of `blocks`, each labelled with its document."""
    import torch

    from hf_depthgrow.data import DOCUMENT_COLUMN

    ones = torch.ones(blocks.shape[1], dtype=torch.long)
    return [{"input_ids": b, "attention_mask": ones, "labels": b, DOCUMENT_COLUMN: int(d)} for b, d in zip(blocks, documents)]


def build_base(cfg, vocab_size: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                         num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
                         max_position_embeddings=cfg.block_size, tie_word_embeddings=True, bos_token_id=None, eos_token_id=1,
                         pad_token_id=0)
    return LlamaForCausalLM(config)


def heldout_loss(model, rows: list[dict], batch_size: int = 64) -> float:
    """Token-weighted mean loss of `model` on `rows`."""
    import torch

    from hf_depthgrow.chunked_loss import batch_example_losses

    total = weight = 0.0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(rows), batch_size):
            chunk = rows[i:i + batch_size]
            batch = {k: torch.stack([r[k] for r in chunk]) for k in ("input_ids", "attention_mask", "labels")}
            losses = batch_example_losses(model, batch)
            total += float((losses.per_example.double() * losses.weight.double()).sum())
            weight += float(losses.weight.double().sum())
    model.train()
    return total / weight


def base_rate_factor(cfg, step: int) -> float:
    """The base's rate at `step` as a share of `base_learning_rate`: linear warm-up, constant, and with
    `base_decay_steps` a linear decay from `base_min_steps` to `base_final_learning_rate`, constant after it."""
    warm = min(1.0, (step + 1) / max(cfg.base_warmup_steps, 1))
    if not cfg.base_decay_steps or step < cfg.base_min_steps:
        return warm
    final = cfg.base_final_learning_rate / cfg.base_learning_rate
    done = min(1.0, (step - cfg.base_min_steps) / cfg.base_decay_steps)
    return 1.0 + done * (final - 1.0)


def check_window_ready(cfg, step: int) -> bool:
    """Whether the plateau check may run at `step`: from `base_min_steps`, and with a decay only once the check's
    window (the last `plateau_window` of the steps) lies wholly after the decay, at the final rate."""
    if step < cfg.base_min_steps:
        return False
    return not cfg.base_decay_steps or (1 - cfg.plateau_window) * step >= cfg.base_min_steps + cfg.base_decay_steps


def train_base(model, train_rows: list[dict], heldout_rows: list[dict], cfg, log=print) -> dict:
    """AdamW with linear warm-up then a constant rate (or the decay of `base_rate_factor`), until `plateau_check`
    says flat (`check_window_ready`) or the cap."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.base_learning_rate, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: base_rate_factor(cfg, s))
    gen = torch.Generator().manual_seed(cfg.seed)
    order, cursor = torch.randperm(len(train_rows), generator=gen), 0
    curve, check, started, cpu = [(0, heldout_loss(model, heldout_rows))], None, time.perf_counter(), time.process_time()
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
        log(f"base step {step}: train {loss.item():.4f}, held-out {curve[-1][1]:.4f} ({time.perf_counter() - started:.0f} s wall, "
            f"{time.process_time() - cpu:.0f} s CPU)")
        if check_window_ready(cfg, step):
            check = plateau_check(curve, tolerance=cfg.plateau_tolerance, window=cfg.plateau_window)
            if check["flat"]:
                break
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu  # CPU: the figure a shared machine does not inflate
    check = check or plateau_check(curve, tolerance=cfg.plateau_tolerance, window=cfg.plateau_window)
    cap = not check["flat"] and curve[-1][0] >= cfg.base_max_steps
    check["cap_hit"] = cap
    if cap:
        check["text"] += f"; the cap (base_max_steps={cfg.base_max_steps}) was hit before the curve was flat"
    return {"curve": curve, "plateau": check, "steps": curve[-1][0], "seconds": seconds, "cpu_seconds": cpu,
            "tokens": curve[-1][0] * cfg.base_batch_size * cfg.block_size}


def prepare_base(cfg, log=print):
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
        from hf_depthgrow.utils import kind_of, read_structured

        info = read_structured(info_path, expected="the base's settings (a JSON object)")
        if not isinstance(info, dict):
            raise BaseMismatchError(f"{info_path}: expected the base's settings (a JSON object), got {kind_of(info)}: use another output_dir")
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
    # Retention blocks sampled across the retention pages (documents), so its selection and test parts can be disjoint
    # pages and its bootstrap resamples pages, not neighbouring blocks of a few.
    retention = sampled_rows(tokenizer, text("retention"), cfg.block_size, cfg.retention_blocks, cfg.retention_per_page, cfg.seed,
                             split["retention"])
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
