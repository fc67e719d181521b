"""A grown model trained by `transformers.Trainer` and trl's `SFTTrainer` (hf_depthgrow.training.hf_integration).

What is checked: only the new blocks change (every original weight bit-identical, every new-block weight
moved), the saved folder reloads with `load_pretrained` with its growth record (adapter blocks included),
and the fallback callback keeps a block that helped, resets one that hurt (the model is then exactly the
original) and refuses a run that went non-finite.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainerState, TrainingArguments

from hf_depthgrow import bypass_new_blocks, grow_depth, growth_record, load_pretrained, new_block_parameters
from hf_depthgrow.hub.serialization import ADAPTER_WEIGHTS
from hf_depthgrow.training import NonFiniteTrainingLossError
from hf_depthgrow.training.hf_integration import (
    FALLBACK_KEY,
    FallbackCallback,
    keep_growth_on_save,
    prepare_grown_model,
    write_growth_files,
)

SEQ = 12


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=100, initializer_range=0.2)
    # initializer_range 0.2 (not 0.02): logits large enough that a block can make the loss clearly better or worse.
    return LlamaForCausalLM(config).eval()


def counting_rows(n: int, seed: int) -> list[dict]:
    """Rows of `start, start+1, ...` (mod 90, offset 5): a rule one new block learns in a few steps."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, 90, (n, 1), generator=g)
    ids = (starts + torch.arange(SEQ)) % 90 + 5
    return [{"input_ids": r, "attention_mask": torch.ones_like(r), "labels": r.clone()} for r in ids]


PROBE = torch.stack([r["input_ids"] for r in counting_rows(3, seed=99)])


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=PROBE).logits


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_only_new_blocks_changed(model, before: dict) -> None:
    new = {n for n, _ in new_block_parameters(model)}
    params = dict(model.named_parameters())
    assert new and set(params) == set(before)
    for name, param in params.items():
        if name in new:
            assert not torch.equal(param, before[name]), f"new-block parameter {name} did not train"
        else:
            assert torch.equal(param, before[name]), f"original parameter {name} changed"


def training_args(tmp_path, **overrides) -> TrainingArguments:
    values = dict(output_dir=str(tmp_path / "out"), max_steps=6, per_device_train_batch_size=8, learning_rate=1e-2,
                  use_cpu=True, report_to="none", save_strategy="no", logging_steps=1, seed=0, disable_tqdm=True)
    return TrainingArguments(**{**values, **overrides})


class CorruptAtEnd(TrainerCallback):
    """Before the fallback callback runs: make the new block add a large multiple of token 0's output embedding.

    With `up_proj = gate_proj` every MLP feature is `silu(g) * g >= 0`, so `down_proj` columns all equal to
    `lm_head[0]` push every position towards predicting token 0, which no label is: a block that hurts.
    """

    def on_train_end(self, args, state, control, model=None, **kwargs):
        mlp = model.model.layers[2].mlp
        with torch.no_grad():
            mlp.up_proj.weight.copy_(mlp.gate_proj.weight)
            mlp.down_proj.weight.copy_(100 * model.lm_head.weight[0][:, None].expand_as(mlp.down_proj.weight))


class NanAfterFirstStep(TrainerCallback):
    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 1:
            with torch.no_grad():
                model.model.layers[2].mlp.up_proj.weight[0, 0] = float("nan")


# ------------------------------------------------------------------ preparing


def test_prepare_freezes_all_but_the_new_blocks_and_rejects_ungrown_models():
    model = tiny_llama()
    with pytest.raises(ValueError, match="no new blocks"):
        prepare_grown_model(model)
    with pytest.raises(ValueError, match="needs a transformers model"):
        prepare_grown_model(torch.nn.Linear(2, 2))
    grow_depth(model, [2])
    count = prepare_grown_model(model)
    new = dict(new_block_parameters(model))
    assert count == sum(p.numel() for p in new.values()) > 0
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(new)


# ------------------------------------------------------------------ transformers.Trainer


def test_trainer_trains_only_the_new_block_keeps_it_and_saves_a_reloadable_folder(tmp_path):
    model = grow_depth(tiny_llama(), [2])
    prepare_grown_model(model)
    before, record = snapshot(model), growth_record(model)
    with bypass_new_blocks(model):
        original = logits(model)
    callback = FallbackCallback(counting_rows(16, seed=2), batch_size=8)
    trainer = Trainer(model=model, args=training_args(tmp_path), train_dataset=counting_rows(64, seed=1), callbacks=[callback])
    trainer.train()

    assert_only_new_blocks_changed(model, before)
    decision = callback.result
    assert decision.selected == "new" and decision.reset is None
    assert decision.losses["new"] < decision.losses["old"] and decision.delta == pytest.approx(decision.losses["old"] - decision.losses["new"])
    assert not torch.allclose(logits(model), original)  # the kept block changes the function

    trainer.save_model(str(tmp_path / "model"))
    saved = json.loads((tmp_path / "model" / "config.json").read_text())
    assert saved[FALLBACK_KEY]["selected"] == "new" and saved[FALLBACK_KEY]["num_examples"] == 16
    reloaded = load_pretrained(tmp_path / "model")
    assert growth_record(reloaded) == record
    torch.testing.assert_close(logits(reloaded), logits(model), rtol=0, atol=0)


def test_fallback_resets_a_block_that_made_held_out_loss_worse(tmp_path):
    base, held_out = tiny_llama(), counting_rows(16, seed=2)
    original = logits(base)
    with torch.no_grad():  # the original model's own mean token loss on the held-out rows (all of one length)
        original_loss = base(input_ids=torch.stack([r["input_ids"] for r in held_out]), labels=torch.stack([r["labels"] for r in held_out])).loss
    model = grow_depth(base, [2])
    prepare_grown_model(model)
    start = {n: p.detach().clone() for n, p in new_block_parameters(model)}
    callback = FallbackCallback(held_out, batch_size=8)
    args = training_args(tmp_path, max_steps=2)
    trainer = Trainer(model=model, args=args, train_dataset=counting_rows(16, seed=1), callbacks=[CorruptAtEnd(), callback])
    trainer.train()

    decision = callback.result
    assert decision.selected == "old" and decision.reset == "starting weights"
    assert decision.losses["old"] == pytest.approx(original_loss.item(), rel=1e-5)  # f_old is the original model
    assert decision.losses["new"] > decision.losses["old"] + 1.0
    for name, param in new_block_parameters(model):
        assert torch.equal(param, start[name]), name  # back at zero init
    torch.testing.assert_close(logits(model), original, rtol=0, atol=1e-6)
    trainer.save_model(str(tmp_path / "model"))
    reloaded = load_pretrained(tmp_path / "model")
    assert reloaded.config.depth_growth_fallback["selected"] == "old"
    torch.testing.assert_close(logits(reloaded), original, rtol=0, atol=1e-6)


def test_fallback_after_a_resumed_run_zeroes_the_residual_outputs():
    # A resumed run starts from trained blocks: their starting weights are not f_old, zeroing the outputs is.
    base = tiny_llama()
    original = logits(base)
    model = grow_depth(base, [2])
    prepare_grown_model(model)
    with torch.no_grad():
        for _, param in new_block_parameters(model):
            param.add_(0.5)  # "trained" before this run, residual outputs non-zero
    callback, state = FallbackCallback(counting_rows(8, seed=2)), TrainerState(global_step=7)
    callback.on_train_begin(None, state, None, model=model)
    CorruptAtEnd().on_train_end(None, state, None, model=model)
    callback.on_train_end(None, state, None, model=model)
    assert callback.result.selected == "old" and callback.result.reset == "residual outputs zeroed" and callback.result.step == 7
    torch.testing.assert_close(logits(model), original, rtol=0, atol=1e-6)


def test_fallback_refuses_a_run_that_went_non_finite(tmp_path):
    model = grow_depth(tiny_llama(), [2])
    prepare_grown_model(model)
    callback = FallbackCallback(counting_rows(8, seed=2))
    trainer = Trainer(model=model, args=training_args(tmp_path, max_steps=3), train_dataset=counting_rows(24, seed=1),
                      callbacks=[NanAfterFirstStep(), callback])
    with pytest.raises(NonFiniteTrainingLossError, match="diverged"):
        trainer.train()
    assert callback.result is None and FALLBACK_KEY not in model.config.to_dict()
    # Non-finite blocks found at the end (nothing logged in between) are refused too, and nothing is selected.
    state = TrainerState(global_step=3)
    callback.on_train_begin(None, state, None, model=model)
    with pytest.raises(NonFiniteTrainingLossError, match="NaN/inf"):
        callback.on_train_end(None, state, None, model=model)
    assert callback.result is None


def test_fallback_callback_rejects_bad_input():
    with pytest.raises(ValueError, match="needs eval_data"):
        FallbackCallback(None)
    with pytest.raises(ValueError, match="batch_size"):
        FallbackCallback(counting_rows(4, seed=0), batch_size=0)
    model = grow_depth(tiny_llama(), [2])  # not prepared: every parameter still trains
    with pytest.raises(ValueError, match="outside the new blocks train"):
        FallbackCallback(counting_rows(4, seed=0)).on_train_begin(None, TrainerState(), None, model=model)
    prepare_grown_model(model)
    with pytest.raises(ValueError, match="labels"):
        FallbackCallback([{"input_ids": torch.arange(SEQ)}]).on_train_begin(None, TrainerState(), None, model=model)
    with pytest.raises(NonFiniteTrainingLossError, match="grad_norm"):
        FallbackCallback(counting_rows(4, seed=0)).on_log(None, TrainerState(global_step=4), None, logs={"loss": 2.0, "grad_norm": math.inf})


def test_adapter_blocks_survive_trainer_checkpoints_and_save_model(tmp_path):
    model = grow_depth(tiny_llama(), [2], block="adapter")
    prepare_grown_model(model)
    before, record = snapshot(model), growth_record(model)
    args = training_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=4)
    trainer = Trainer(model=model, args=args, train_dataset=counting_rows(32, seed=1))
    trainer.train()
    assert_only_new_blocks_changed(model, before)
    trainer.save_model(str(tmp_path / "model"))
    checkpoint = tmp_path / "out" / "checkpoint-4"
    for folder in (checkpoint, tmp_path / "model"):
        assert (folder / ADAPTER_WEIGHTS).is_file()
        reloaded = load_pretrained(folder)
        assert growth_record(reloaded) == record
        torch.testing.assert_close(logits(reloaded), logits(model), rtol=0, atol=0)
    # The main checkpoint keeps the adapter weights too: Trainer's resume_from_checkpoint reads them there.
    from safetensors import safe_open

    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        assert any(".depthgrow_pre." in key for key in f.keys())


def test_plain_save_loses_adapter_blocks_and_write_growth_files_repairs_it(tmp_path):
    model = grow_depth(tiny_llama(), [2], block="adapter")
    with torch.no_grad():
        for _, param in new_block_parameters(model):
            param.add_(0.1)
    type(model).save_pretrained(model, str(tmp_path / "plain"))  # what a trainer does without keep_growth_on_save
    with pytest.raises(ValueError, match=ADAPTER_WEIGHTS):
        load_pretrained(tmp_path / "plain")
    write_growth_files(model, tmp_path / "plain")
    torch.testing.assert_close(logits(load_pretrained(tmp_path / "plain")), logits(model), rtol=0, atol=0)
    # The hook is a bound method: a deep copy saves itself, not the model it was copied from.
    import copy

    keep_growth_on_save(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.model.layers[2].depthgrow_pre[0].w_out.weight.add_(1.0)
    twin.save_pretrained(str(tmp_path / "twin"))
    torch.testing.assert_close(logits(load_pretrained(tmp_path / "twin")), logits(twin), rtol=0, atol=0)


# ------------------------------------------------------------------ trl's SFTTrainer


def char_tokenizer():
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = "abcdefghijklmnopqrstuvwxyz .,"
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


def test_sft_trainer_trains_only_the_new_block_and_saves_a_reloadable_folder(tmp_path):
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    tok = char_tokenizer()
    texts = ["the cat sat on the mat.", "a dog ran in the fog.", "we go to the sea now.", "so the end is near, is it."]
    train = Dataset.from_dict({"text": texts * 8})
    held_out = [{"input_ids": torch.tensor(ids), "labels": torch.tensor(ids)} for ids in tok(texts)["input_ids"]]
    model = grow_depth(tiny_llama(), [2])
    prepare_grown_model(model)
    before, record = snapshot(model), growth_record(model)
    callback = FallbackCallback(held_out, batch_size=4)
    config = trl.SFTConfig(output_dir=str(tmp_path / "out"), max_steps=6, per_device_train_batch_size=8, learning_rate=1e-2,
                           use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=1, max_length=32,
                           seed=0, disable_tqdm=True, activation_checkpointing=True)  # trl's default, under its current name
    trainer = trl.SFTTrainer(model=model, args=config, train_dataset=train, processing_class=tok, callbacks=[callback])
    trainer.train()

    assert_only_new_blocks_changed(model, before)
    assert callback.result.selected == "new" and callback.result.losses["new"] < callback.result.losses["old"]
    trainer.save_model(str(tmp_path / "model"))
    reloaded = load_pretrained(tmp_path / "model")
    assert growth_record(reloaded) == record
    assert reloaded.config.depth_growth_fallback["selected"] == "new"
    torch.testing.assert_close(logits(reloaded), logits(model), rtol=0, atol=0)


# ------------------------------------------------------------------ SFTTrainer(peft_config=DepthGrowConfig(...))


def _sft_texts():
    from datasets import Dataset

    texts = ["the cat sat on the mat.", "a dog ran in the fog.", "we go to the sea now.", "so the end is near, is it."]
    return texts, Dataset.from_dict({"text": texts * 8})


def _peft_sft(trl, tmp_path, out: str, **overrides):
    from hf_depthgrow.integrations.peft_method import DepthGrowConfig

    _, train = _sft_texts()
    # SFTConfig's defaults otherwise: bf16 on (also on CPU), activation checkpointing on.
    settings = dict(output_dir=str(tmp_path / out), max_steps=4, per_device_train_batch_size=8, learning_rate=1e-2, use_cpu=True,
                    report_to="none", save_strategy="steps", save_steps=2, logging_steps=1, max_length=32, seed=0, disable_tqdm=True)
    config = trl.SFTConfig(**{**settings, **overrides})
    return trl.SFTTrainer(model=tiny_llama(), args=config, train_dataset=train, processing_class=char_tokenizer(),
                          peft_config=DepthGrowConfig(positions=[2]))


def test_sft_trainer_with_a_depthgrow_peft_config_trains_the_new_block_saves_an_adapter_and_resumes(tmp_path):
    trl = pytest.importorskip("trl")
    from peft import PeftModel
    from safetensors.torch import load_file

    from hf_depthgrow.training.hf_integration import unwrap_autocast

    assert trl.SFTConfig(output_dir=str(tmp_path / "d"), use_cpu=True).bf16  # the default this test runs with
    trainer = _peft_sft(trl, tmp_path, "run")
    peft_model = trainer.model
    base_before = {n: p.detach().clone() for n, p in peft_model.named_parameters() if not p.requires_grad}
    new_before = {n: p.detach().clone() for n, p in peft_model.named_parameters() if p.requires_grad}
    assert new_before and all(".layers.2." in n for n in new_before)  # only the new block trains
    trainer.train()
    for name, value in peft_model.named_parameters():
        if name in base_before:
            assert torch.equal(value, base_before[name]), name
        elif not name.endswith(("o_proj.weight", "down_proj.weight")):  # zero-init outputs move; the rest after them
            continue
        else:
            assert not torch.equal(value, new_before[name]), name
    # Checkpoints hold the adapter only: the new block's tensors, no copy of the base.
    checkpoint = tmp_path / "run" / "checkpoint-2"
    assert not (checkpoint / "model.safetensors").exists()
    assert {k.split(".layers.")[1].split(".")[0] for k in load_file(checkpoint / "adapter_model.safetensors")} == {"2"}

    # bf16 training leaves accelerate's autocast wrapper on the model's forward: in memory it computes in bf16, so
    # its logits differ from those of its saved float32 copy, which equal the in-memory ones under bf16 autocast.
    trainer.save_model(str(tmp_path / "adapter"))
    saved = PeftModel.from_pretrained(tiny_llama(), tmp_path / "adapter").eval()
    peft_model.eval()
    assert (logits(peft_model) - logits(saved)).abs().max().item() > 1e-3
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(logits(saved).float(), logits(peft_model).float(), rtol=0, atol=0)
    assert unwrap_autocast(peft_model) is peft_model
    torch.testing.assert_close(logits(peft_model), logits(saved), rtol=0, atol=0)  # float32 again: exactly the saved copy

    # Resuming from the step-2 checkpoint ends at the same weights as the straight run.
    resumed = _peft_sft(trl, tmp_path, "resumed")
    resumed.train(resume_from_checkpoint=str(checkpoint))
    trained = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
    for name, value in resumed.model.named_parameters():
        if value.requires_grad:
            torch.testing.assert_close(value, trained[name], rtol=0, atol=0)


def test_fallback_callback_compares_float32_functions_after_bf16_training(tmp_path):
    """With bf16 on, the callback's losses and the trained model in memory are those of the saved float32 model."""
    trl = pytest.importorskip("trl")

    texts, train = _sft_texts()
    tok = char_tokenizer()
    held_out = [{"input_ids": torch.tensor(ids), "labels": torch.tensor(ids)} for ids in tok(texts)["input_ids"]]
    model = grow_depth(tiny_llama(), [2])
    prepare_grown_model(model)
    callback = FallbackCallback(held_out, batch_size=4)
    config = trl.SFTConfig(output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=8, learning_rate=1e-2,
                           use_cpu=True, bf16=True, report_to="none", save_strategy="no", max_length=32, seed=0, disable_tqdm=True)
    trl.SFTTrainer(model=model, args=config, train_dataset=train, processing_class=tok, callbacks=[callback]).train()
    model.save_pretrained(str(tmp_path / "model"))
    reloaded = load_pretrained(tmp_path / "model")
    torch.testing.assert_close(logits(model), logits(reloaded), rtol=0, atol=0)
    assert callback.result.losses["new"] == pytest.approx(_mean_row_loss(reloaded, held_out), rel=1e-6)


def _mean_row_loss(model, rows) -> float:
    """Token-weighted mean loss of `rows` in float32, one row at a time (no padding)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            out = model(input_ids=row["input_ids"][None], labels=row["labels"][None])
            n = row["labels"].numel() - 1
            total, count = total + out.loss.item() * n, count + n
    return total / count


def test_fallback_callback_works_on_the_peft_config_route(tmp_path):
    """`SFTTrainer(peft_config=DepthGrowConfig(...), callbacks=[FallbackCallback(...)])`: the callback gets the
    `PeftModel` and applies the rule to the grown model inside it (it failed on the PeftModel before)."""
    trl = pytest.importorskip("trl")

    texts, _ = _sft_texts()
    held_out = [{"input_ids": torch.tensor(ids), "labels": torch.tensor(ids)} for ids in char_tokenizer()(texts)["input_ids"]]
    callback = FallbackCallback(held_out, batch_size=4)
    trainer = _peft_sft(trl, tmp_path, "run", save_strategy="no")
    trainer.add_callback(callback)
    trainer.train()
    assert callback.result.selected == "new" and callback.result.losses["new"] < callback.result.losses["old"]
    # f_old is exactly the untouched base model; the decision is in the grown model's config.
    assert callback.result.losses["old"] == pytest.approx(_mean_row_loss(tiny_llama(), held_out), rel=1e-6)
    assert trainer.model.get_base_model().config.depth_growth_fallback["selected"] == "new"


def test_the_trainer_integration_loads_on_first_use_so_reading_results_skips_peft():
    import subprocess
    import sys

    code = ("import sys, hf_depthgrow.comparison.gather, hf_depthgrow.training as t; assert 'peft' not in sys.modules, 'peft'; "
            "from hf_depthgrow.training.hf_integration import FallbackCallback as F; assert t.FallbackCallback is F")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
