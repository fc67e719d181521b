"""`accelerate launch --config_file recipes/accelerate_configs/fsdp.yaml` on CPU processes shards for real.

accelerate 1.16 builds an FSDP state only for GPU-like devices: on a CPU-only machine the launch starts two
processes that ran DDP, silently, with `GrownTrainer`. `sharding.launched_fsdp_accelerator` now gives them
FSDP2 (the plugin read from the launcher's `FSDP_*` variables).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SCRIPT = '''
import json, os, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from hf_depthgrow import grow_depth
from hf_depthgrow.training import GrownTrainer, TrainConfig
from hf_depthgrow.training.sharding import is_sharded

torch.set_num_threads(1)
torch.manual_seed(0)
config = LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=128, vocab_size=100)
model = grow_depth(LlamaForCausalLM(config).eval(), [2])
ids = (torch.randint(0, 100, (16, 1), generator=torch.Generator().manual_seed(3)) + torch.arange(16)) % 100
rows = [{"input_ids": r, "attention_mask": torch.ones_like(r), "labels": r.clone()} for r in ids]
settings = TrainConfig(output_dir=os.path.join(sys.argv[1], "run"), max_steps=2, per_device_train_batch_size=2,
                       logging_steps=1, progress_bar=False, eval_steps=0, seed=5)
trainer = GrownTrainer(model, settings, rows[:12], rows[12:])  # no accelerator given: the launch decides
trainer.train()
with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump({"distributed_type": str(trainer.accelerator.distributed_type), "sharded": is_sharded(trainer.model)}, f)
'''


def test_no_fsdp_launch_means_no_fsdp_accelerator(monkeypatch):
    from hf_depthgrow.training.sharding import launched_fsdp_accelerator

    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert launched_fsdp_accelerator() is None


def test_an_fsdp1_launch_config_is_refused_with_one_line(monkeypatch):
    from hf_depthgrow.training import sharding

    monkeypatch.setattr(sharding, "_gpu_like_available", lambda: False)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ValueError, match="asks for FSDP1; on CPU processes hf_depthgrow shards with FSDP2 only"):
        sharding.launched_fsdp_accelerator()


@pytest.mark.slow
def test_accelerate_launch_with_the_fsdp_config_shards_on_cpu(tmp_path):
    script = tmp_path / "launched.py"
    script.write_text(SCRIPT)
    # CPU processes even where a GPU is present: that is the case accelerate alone turned into DDP.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(REPO / "recipes" / "accelerate_configs" / "fsdp.yaml"), "--num_processes", "2", "--mixed_precision", "no",
               str(script), str(tmp_path)]
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got == {"distributed_type": "DistributedType.FSDP", "sharded": True}, got
    assert (tmp_path / "run" / "model").is_dir()
