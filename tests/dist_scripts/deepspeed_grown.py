"""Two-process DeepSpeed ZeRO-2 / ZeRO-3 jobs on a grown tiny Llama, launched by tests/test_distributed.py under torchrun.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist_scripts/deepspeed_grown.py \
        --root OUT --base BASE --jobs '[{"kind": "direct", "stage": 2}, {"kind": "trainer", "name": "z2", "env": {...}}]'

Jobs run in order in one process group (one launch pays the imports once):

- `direct`: DeepSpeed driven by hand (`deepspeed_zero.train_zero`); rank 0 writes `zero{stage}.pt`.
- `trainer`: `GrownTrainer` with no accelerator given, in the environment `env` (the `ACCELERATE_*`
  variables `accelerate launch --config_file recipes/accelerate_configs/deepspeed/zero{2,3}.yaml`
  sets, which the test computes with accelerate's own launcher code): the trainer builds its
  accelerator itself (`deepspeed_support.deepspeed_accelerator`), as under the real launch. Writes
  `<root>/<name>/` like any run. `abandon_after_step: n` drops the run after step n (no final save).
- `refused`: the same, expecting a `ValueError` before any work; rank 0 writes `<root>/<name>.json`
  with the message and whether the output folder was created.
- `partitioned`: the base loaded under `deepspeed.zero.Init` (what `zero3_init_flag: true` makes
  `from_pretrained` do), then `grow_depth`; rank 0 writes `<root>/partitioned.json`: the error, the
  layer count after the call and the local shape of a layer's weight.

accelerate keeps one state per process; between jobs it is reset (the process group stays), so that
each job gets the plugin of its own environment.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from deepspeed_zero import ds_config, train_zero  # noqa: E402
from fsdp2_grown import grown_model, train_or_abandon, trainer_config, trainer_data  # noqa: E402


def fresh_accelerate_state(env: dict) -> None:
    """Forget the previous job's accelerate state and DeepSpeed plugin; take `env`'s `ACCELERATE_*` variables."""
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType
    from transformers.integrations import unset_hf_deepspeed_config

    AcceleratorState._reset_state()  # not PartialState: the process group stays
    GradientState._reset_state()
    if PartialState._shared_state:
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_CPU  # what it was before the switch
    unset_hf_deepspeed_config()
    for key in [k for k in os.environ if k.startswith("ACCELERATE_")]:
        del os.environ[key]
    os.environ.update(env)


def run_trainer(root: Path, base: Path, job: dict) -> None:
    from hf_depthgrow.training import GrownTrainer

    fresh_accelerate_state(job["env"])
    settings = {k: v for k, v in job.items() if k not in ("kind", "name", "env", "abandon_after_step")}
    out = root / job["name"]
    config = trainer_config(output_dir=str(out), **settings)
    train_rows, held_out = trainer_data()
    trainer = GrownTrainer(grown_model(base), config, train_rows, held_out)
    if job["kind"] == "refused":
        try:
            trainer.train()
        except ValueError as err:
            if int(os.environ["RANK"]) == 0:
                (root / f"{job['name']}.json").write_text(json.dumps({"error": str(err), "output_dir_created": out.exists()}))
            return
        raise AssertionError(f"job {job['name']} was not refused")
    train_or_abandon(trainer, job)


def run_partitioned(root: Path, base: Path) -> None:
    from transformers import LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig, unset_hf_deepspeed_config

    from hf_depthgrow import grow_depth

    registered = HfDeepSpeedConfig(ds_config(3, int(os.environ["WORLD_SIZE"])))  # transformers holds it weakly: kept alive here
    assert registered.is_zero3()
    model = LlamaForCausalLM.from_pretrained(base)  # under zero.Init: partitioned as it is built
    unset_hf_deepspeed_config()
    error = None
    try:
        grow_depth(model, [2])
    except ValueError as err:
        error = str(err)
    if int(os.environ["RANK"]) == 0:
        got = {"error": error, "layers": len(model.model.layers), "local_shape": list(model.model.layers[1].mlp.down_proj.weight.shape)}
        (root / "partitioned.json").write_text(json.dumps(got))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--base", required=True, help="the folder fsdp2_grown.pretrain_base wrote")
    parser.add_argument("--jobs", required=True, help="JSON list of job dicts")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import deepspeed

    from hf_depthgrow.training.deepspeed_support import disable_shm_comm

    print(f"[rank {os.environ['RANK']}] imports: {time.process_time():.1f} CPU s", flush=True)
    disable_shm_comm()
    deepspeed.init_distributed(dist_backend="gloo")  # accelerate joins this group instead of making its own
    root, base = Path(args.root), Path(args.base)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        for job in json.loads(args.jobs):
            cpu = time.process_time()
            if job["kind"] == "direct":
                result = train_zero(base, job["stage"], rank, world)
                if rank == 0:
                    torch.save(result, root / f"zero{job['stage']}.pt")
            elif job["kind"] == "partitioned":
                run_partitioned(root, base)
            else:
                run_trainer(root, base, job)
            torch.distributed.barrier()
            # Process CPU time per job (the wall clock says little on a shared machine).
            print(f"[rank {rank}] job {job.get('name', job['kind'] + str(job.get('stage')))}: {time.process_time() - cpu:.1f} CPU s", flush=True)
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
