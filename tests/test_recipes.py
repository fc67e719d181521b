"""Every shipped recipe config and accelerate config loads and validates (no training here)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
# Training recipes; the scaling study's configs (configs/scaling/) are validated in test_scaling_study.py,
# the SFTTrainer recipe's (configs/sft_trl/, trl's own config) in test_recipe_sft_trl.py, the regime study's in test_regime_study.py.
RECIPE_CONFIGS = sorted(p for p in (RECIPES / "configs").rglob("*.yaml") if p.parent.name not in ("scaling", "sft_trl", "regime_study"))
ACCELERATE_CONFIGS = sorted((RECIPES / "accelerate_configs").glob("*.yaml"))


def load_recipe(task: str):
    spec = importlib.util.spec_from_file_location(f"recipe_{task}", RECIPES / f"{task}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


def test_every_task_has_a_recipe_and_configs():
    tasks = {p.parent.name for p in RECIPE_CONFIGS}
    assert tasks == {"causal_lm", "text_classification", "image_classification"}
    for task in tasks:
        assert (RECIPES / f"{task}.py").exists()


@pytest.mark.parametrize("path", RECIPE_CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_recipe_config_validates(path):
    from hf_depthgrow.config import ScriptArguments
    from hf_depthgrow.training.config import TrainConfig

    task = path.parent.name
    recipe = load_recipe(task)
    parsed = recipe.parse(["--config", str(path)])
    args, config = parsed[0], parsed[1]
    assert isinstance(args, ScriptArguments) and isinstance(config, TrainConfig)
    assert args.positions, "a recipe config says where to grow"
    assert args.dataset
    # Every key of the file reached a dataclass (the parser rejects unknown keys).
    values = yaml.safe_load(path.read_text())
    got = {**vars(args), **vars(config), **vars(parsed[2])}
    for key, value in values.items():
        assert got[key] == value, key
    # The header gives the exact launch command for this very file.
    assert f"accelerate launch recipes/{task}.py --config {path.relative_to(REPO)}" in path.read_text()


@pytest.mark.parametrize("task", ["causal_lm", "text_classification", "image_classification"])
def test_recipe_docstring_opens_with_launch_command(task):
    recipe = load_recipe(task)
    assert f"accelerate launch recipes/{task}.py --config recipes/configs/{task}/" in recipe.__doc__.split("\n\n")[1]


def test_command_line_overrides_config(tmp_path):
    recipe = load_recipe("causal_lm")
    path = RECIPES / "configs" / "causal_lm" / "smollm2_shakespeare.yaml"
    args, config, _ = recipe.parse(["--config", str(path), "--max-steps", "7", "--positions", "3", "5"])
    assert config.max_steps == 7 and args.positions == [3, 5]


def test_unknown_or_invalid_keys_are_errors(tmp_path):
    recipe = load_recipe("causal_lm")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: smollm2\nlerning_rate: 0.1\n")
    with pytest.raises(ValueError, match="unknown key 'lerning_rate'; did you mean 'learning_rate'"):
        recipe.parse(["--config", str(bad)])
    bad.write_text("model: smollm2\ntrainable: everything\n")
    with pytest.raises(ValueError, match="trainable"):
        recipe.parse(["--config", str(bad)])
    with pytest.raises(ValueError, match="unknown option --max-stepz; did you mean --max-steps"):
        recipe.parse(["--config", str(RECIPES / "configs" / "causal_lm" / "smollm2_shakespeare.yaml"), "--max-stepz", "3"])


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_accelerate_config_validates(path):
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import DistributedType

    config = ClusterConfig.from_yaml_file(str(path))  # accelerate's own loader: unknown keys raise
    expected = {"single_gpu.yaml": DistributedType.NO, "multi_gpu.yaml": DistributedType.MULTI_GPU, "fsdp.yaml": DistributedType.FSDP}
    assert config.distributed_type == expected[path.name]
    assert config.mixed_precision in ("no", "fp16", "bf16")
    assert f"accelerate launch --config_file recipes/accelerate_configs/{path.name}" in path.read_text()
    if config.distributed_type == DistributedType.FSDP:
        assert config.fsdp_config["fsdp_version"] == 2


def test_causal_lm_recipe_checkpoints_models_from_a_size():
    from hf_depthgrow.testing import tiny_model
    from hf_depthgrow.training.config import TrainConfig

    recipe = load_recipe("causal_lm")
    _, _, extras = recipe.parse(["--config", str(RECIPES / "configs" / "causal_lm" / "smollm2_shakespeare.yaml")])
    assert extras.gradient_checkpointing_above == 1_000_000_000  # SmolLM2-135M trains without it
    model = tiny_model("llama")
    count = sum(p.numel() for p in model.parameters())
    assert recipe.with_checkpointing_above(TrainConfig(), model, count).gradient_checkpointing
    assert not recipe.with_checkpointing_above(TrainConfig(), model, count + 1).gradient_checkpointing
    assert not recipe.with_checkpointing_above(TrainConfig(), model, None).gradient_checkpointing
    assert recipe.with_checkpointing_above(TrainConfig(gradient_checkpointing=True), model, None).gradient_checkpointing
