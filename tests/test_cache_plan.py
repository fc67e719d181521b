"""prefix_cache="auto" builds the cache only when the planned run is predicted to save prefix work, and says so."""

import pytest
import torch

from hf_depthgrow import grow_depth
from hf_depthgrow.testing import tiny_model
from hf_depthgrow.training import TrainConfig, train
from hf_depthgrow.training.cache_plan import MIN_SAVING, choose_auto, plan_prefix_work


def lm_rows(n: int, seq: int = 16, vocab: int = 128) -> list[dict]:
    ids = torch.randint(2, vocab, (n, seq), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": i.clone()} for i in ids]


def cfg(**kw) -> TrainConfig:
    base = dict(per_device_train_batch_size=4, learning_rate=1e-3, progress_bar=False, fallback=False, logging_steps=1)
    return TrainConfig(**{**base, **kw})


def test_one_epoch_without_reuse_saves_nothing():
    plan = plan_prefix_work(cfg(max_steps=4), n_train=16, n_eval=0)
    assert plan.epochs == 1.0 and plan.uncached == plan.cached == 16 and plan.saving == 0.0
    use, why = choose_auto(cfg(max_steps=4), 16, 0)
    assert not use and "not built" in why and "1 epoch" in why


def test_epochs_held_out_passes_and_the_fallback_rule_are_counted():
    # 3 epochs: 48 visits against a 16-row build.
    assert plan_prefix_work(cfg(max_steps=12), 16, 0).saving == pytest.approx(1 - 16 / 48)
    # num_train_epochs counts steps as the trainer does (whole global batches).
    assert plan_prefix_work(cfg(num_train_epochs=2.0), 18, 0).uncached == 2 * 4 * 4
    # One epoch, but the fallback rule passes twice over 8 selection rows and the held-out set is seen
    # before, at steps 2 and 4 (of 4: step 4 is the final pass) -> 16 + 16 + 3 x 8 against 16 + 8.
    plan = plan_prefix_work(cfg(max_steps=4, fallback=True, selection_max_examples=8, eval_steps=2), 16, 8)
    assert (plan.uncached, plan.cached) == (16 + 16 + 3 * 8, 24)
    assert choose_auto(cfg(max_steps=4, fallback=True, selection_max_examples=8, eval_steps=2), 16, 8)[0]
    # Gradient accumulation and processes multiply the visits per step.
    assert plan_prefix_work(cfg(max_steps=2, gradient_accumulation_steps=2), 16, 0, world=2).uncached == 2 * 2 * 4 * 2


def test_the_margin_decides_small_savings():
    # 17 visits of 16 rows saves 1/17 < MIN_SAVING: not worth the cache's memory.
    plan = plan_prefix_work(cfg(max_steps=17, per_device_train_batch_size=1), 16, 0)
    assert 0 < plan.saving < MIN_SAVING
    assert not choose_auto(cfg(max_steps=17, per_device_train_batch_size=1), 16, 0)[0]


def test_trainer_reports_the_auto_choice():
    data = lm_rows(16)
    one_epoch = train(grow_depth(tiny_model("llama"), [2]), data, config=cfg(max_steps=4))
    assert one_epoch.prefix_cache is None
    assert one_epoch.prefix_cache_choice.startswith("prefix cache not built")
    three = train(grow_depth(tiny_model("llama"), [2]), data, config=cfg(max_steps=12))
    assert three.prefix_cache is not None and three.prefix_cache["mode"] == "memory"
    assert three.prefix_cache_choice.startswith("prefix cache built") and "3 epoch" in three.prefix_cache_choice
    assert three.to_dict()["prefix_cache_choice"] == three.prefix_cache_choice
    # What the user asks for explicitly is what they get, with the reason saying so.
    forced = train(grow_depth(tiny_model("llama"), [2]), data, config=cfg(max_steps=4, prefix_cache="memory"))
    assert forced.prefix_cache is not None and "prefix_cache='memory'" in forced.prefix_cache_choice
    # Nothing frozen below: off, whatever the epochs.
    full = train(grow_depth(tiny_model("llama"), [2]), data, config=cfg(max_steps=12, trainable="full"))
    assert full.prefix_cache is None and "nothing frozen" in full.prefix_cache_choice


def test_an_in_memory_cache_lives_on_the_gpu_while_it_fits(monkeypatch):
    # On an H200 a CPU-resident cache made SmolLM2's cached steps 0.45x as fast as uncached ones (a host gather
    # and copy per step): the cache goes to the GPU when it takes at most DEVICE_CACHE_SHARE of the free memory.
    from hf_depthgrow.training import prefix_cache as pc

    free = 4 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 8 * 2**30))
    gpu = torch.device("cuda", 0)
    assert pc.memory_device(gpu, 2**30) == gpu  # a quarter of the free memory
    assert pc.memory_device(gpu, 2**30 + 1) == torch.device("cpu")
    assert pc.memory_device("cpu", 1) == torch.device("cpu")  # a CPU model's cache stays in CPU memory
