"""recipes/sft_trl.py: its config validates, and a short run on a tiny Llama writes a grown model that reloads."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from test_recipes import REPO, load_recipe

CONFIGS = sorted((REPO / "recipes" / "configs" / "sft_trl").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_validates_and_names_its_command(path):
    from hf_depthgrow.config import ScriptArguments

    recipe = load_recipe("sft_trl")
    args, sft = recipe.parse(["--config", str(path)])
    assert isinstance(args, ScriptArguments) and isinstance(sft, recipe.SFTArguments)
    assert args.positions and args.dataset
    got = {**vars(args), **vars(sft)}
    for key, value in yaml.safe_load(path.read_text()).items():  # every key reached a dataclass
        assert got[key] == value, key
    assert f"accelerate launch recipes/sft_trl.py --config {path.relative_to(REPO)}" in path.read_text()
    assert "accelerate launch recipes/sft_trl.py --config recipes/configs/sft_trl/" in recipe.__doc__.split("\n\n")[1]


def test_sft_config_carries_the_settings_and_bad_values_are_errors(tmp_path):
    pytest.importorskip("trl")
    recipe = load_recipe("sft_trl")
    path = CONFIGS[0]
    args, sft = recipe.parse(["--config", str(path), "--max-steps", "7", "--save-steps", "5"])
    config = sft.sft_config(args.block_size)
    assert (config.max_steps, config.learning_rate, config.max_length, config.save_steps) == (7, sft.learning_rate, args.block_size, 5)
    assert config.gradient_checkpointing is False and config.bf16 is False and config.packing is False
    with pytest.raises(ValueError, match="max[-_]steps must be an int >= 1"):
        recipe.parse(["--config", str(path), "--max-steps", "0"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: smollm2\nlerning_rate: 0.1\n")
    with pytest.raises(ValueError, match="unknown key 'lerning_rate'; did you mean 'learning_rate'"):
        recipe.parse(["--config", str(bad)])
    with pytest.raises(ValueError, match="stepping_stone is not supported"):
        recipe.run(*recipe.parse(["--config", str(path), "--stepping-stone"]))


def test_short_run_on_a_tiny_llama_trains_only_the_new_block_and_reloads(tmp_path):
    pytest.importorskip("trl")
    from tiny_lm import make_tiny_lm

    from hf_depthgrow import growth_record, load_pretrained

    make_tiny_lm(tmp_path, max_chars=30_000)  # also writes sample.txt: that Shakespeare sample (load_data reads a .txt)
    recipe = load_recipe("sft_trl")
    out = tmp_path / "run"
    argv = ["--config", str(CONFIGS[0]), "--model", str(tmp_path / "tiny"), "--positions", "2", "--block-size", "32",
            "--dataset", str(tmp_path / "sample.txt"),
            "--max-examples", "40", "--held-out-fraction", "0.2", "--max-steps", "3", "--warmup-steps", "0",
            "--per-device-train-batch-size", "4", "--per-device-eval-batch-size", "8", "--output-dir", str(out)]
    assert recipe.main(argv) == 0

    summary = json.loads((out / "sft_summary.json").read_text())
    assert len(summary["train_losses"]) == 3 and summary["num_train_examples"] == 32
    grown = load_pretrained(out / "model")
    record = growth_record(grown)
    assert (record.base_num_layers, record.native_indices) == (4, (2,))
    assert grown.config.depth_growth_fallback == summary["fallback"]
    assert summary["fallback"]["selected"] in ("new", "old") and summary["fallback"]["num_examples"] == 8
    # Every original layer (and embeddings, norm, head) is bit-identical to the model the run started from.
    base = load_pretrained(tmp_path / "tiny").state_dict()
    state = grown.state_dict()
    old_layer = {f"model.layers.{j}.": f"model.layers.{i}." for j, i in enumerate(record.old_indices)}
    for name, tensor in base.items():
        prefix = next((p for p in old_layer if name.startswith(p)), None)
        mapped = old_layer[prefix] + name[len(prefix):] if prefix else name
        assert torch.equal(state[mapped], tensor), name
    new = [n for n in state if n.startswith("model.layers.2.")]
    assert summary["trainable_parameters"] == sum(state[n].numel() for n in new)
