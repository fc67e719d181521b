"""Training memory: gradient checkpointing on and off, and the memory planner's prediction against the measurement.

    python benchmarks/bench_memory.py --repeats 3 --write-results            # SmolLM2-135M, checkpointing off / on
    python benchmarks/bench_memory.py --repeats 1 --large --write-results    # also a random ~1B Llama config (about 6 GB)

Every measurement is one fresh process (`--worker`): it imports torch and the library, reads its resident
memory (`VmRSS`, the process baseline), builds the model, grows it, sets the trainer up (no prefix cache, no
fallback rule, no evaluation: only the training step), gives freed heap memory back (`malloc_trim`), resets the
kernel's peak-RSS counter (`/proc/self/clear_refs`) and runs `--steps` optimizer steps; `VmHWM` after them is the
peak resident memory of training. The figure compared is that peak minus the baseline: the model, gradients,
AdamW state, activations and allocator slack, without the interpreter and torch's libraries (about 500 MB
that no planner of device memory would count). `ru_maxrss` of the whole process is listed too.

SmolLM2-135M-Instruct is the shipped model (`load_model("smollm2")`, fp32); the ~1B model is Llama-3.2-1B's
shape (16 layers, d=2048, vocabulary 128256, tied head) with random weights, built from a `config.json` the
benchmark writes. The planner (`hf_depthgrow.training.plan_memory`) reads only that config, on the
meta device. Configurations alternate (off, on, off, on, ...) so that drift on the shared machine hits both.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the shared RESULTS.md writer next to this script
from results_file import command_line, machine, write_section  # noqa: E402

REPO = HERE.parent
SECTION_CKPT = "## Trainer: peak memory with and without gradient checkpointing"
SECTION_PLAN = "## Memory planner: predicted against measured peak"
MiB = 2**20
# Llama-3.2-1B's shape (random weights here): ~1.24B parameters, 4.9 GB in fp32.
LLAMA_1B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=2048,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True, hidden_act="silu", bos_token_id=1, eos_token_id=2,
)


def _status_kb(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _trim_heap() -> None:
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass


def _model(source: str):
    import torch

    from hf_depthgrow import load_model

    if source == "smollm2":
        return load_model("smollm2", dtype=torch.float32)[0]
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source), dtype=torch.float32)


def worker(args) -> dict:
    """One measurement in this (fresh) process; returns the figures as a dict."""
    import resource

    import torch

    from hf_depthgrow import grow_depth
    from hf_depthgrow.training import GrownTrainer, TrainConfig

    torch.set_num_threads(args.threads)
    baseline = _status_kb("VmRSS")
    model = _model(args.model)
    grow_depth(model, args.positions, block="native", init="copy")
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    rows = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
            for ids in torch.randint(2, vocab, (args.batch * (args.steps + 1), args.seq), generator=g)]
    cfg = TrainConfig(
        trainable=args.trainable, max_steps=10_000, per_device_train_batch_size=args.batch, learning_rate=1e-4, fallback=False,
        prefix_cache="off", progress_bar=False, seed=0, gradient_checkpointing=args.gradient_checkpointing,
    )
    trainer = GrownTrainer(model, cfg, rows)
    trainer.setup()
    _trim_heap()
    before = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        trainer.training_step(step)
    return {
        "baseline_mb": baseline / 1024,
        "before_steps_mb": before / 1024,
        "peak_mb": _status_kb("VmHWM") / 1024,
        "measured_mb": (_status_kb("VmHWM") - baseline) / 1024,
        "ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "seconds_per_step": (time.perf_counter() - t0) / args.steps,
        "parameters": sum(p.numel() for p in model.parameters()),
        "trainable_parameters": trainer.num_trainable,
    }


# glibc serves every buffer of 64 KiB or more with its own mmap and unmaps it when freed: resident memory is then
# the live tensors (what a planner of device memory predicts). By default glibc raises that threshold to the size
# of the largest buffer freed so far (up to 32 MiB), so freed buffers stay in its heap, which the RSS keeps seeing.
ALLOCATORS = {"glibc default": {}, "mmap >= 64 KiB": {"MALLOC_MMAP_THRESHOLD_": "65536"}}


def _run_worker(args, model: str, positions: list[int], on: bool, batch: int, seq: int, allocator: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--model", model, "--positions", *map(str, positions), "--batch", str(batch),
           "--seq", str(seq), "--steps", str(args.steps), "--threads", str(args.threads), "--trainable", args.trainable]
    if on:
        cmd.append("--gradient-checkpointing")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS=str(args.threads))
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    env.update(ALLOCATORS[allocator])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {model} checkpointing={on} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _predicted(model: str, positions, on: bool, batch: int, seq: int, trainable: str) -> dict:
    from hf_depthgrow.training import PlanSettings, plan_memory

    settings = PlanSettings(positions=list(positions), trainable=trainable, seq=seq, batch=batch, gradient_checkpointing=on)
    return plan_memory(model, settings).to_dict()


def _measure(args, name: str, model: str, positions, batch: int, seq: int, repeats: int) -> dict:
    plans = {on: _predicted(model, positions, on, batch, seq, args.trainable) for on in (False, True)}
    runs = {f"{alloc}|{on}": [] for alloc in ALLOCATORS for on in (False, True)}
    for r in range(repeats):
        for alloc in ALLOCATORS:
            for on in (False, True):
                out = _run_worker(args, model, positions, on, batch, seq, alloc)
                runs[f"{alloc}|{on}"].append(out)
                print(f"{name} repeat {r} [{alloc}] checkpointing={'on' if on else 'off'}: peak - baseline {out['measured_mb']:.0f} MB, "
                      f"{out['seconds_per_step']:.1f} s/step", flush=True)
    return {"name": name, "model": model, "positions": list(positions), "batch": batch, "seq": seq, "runs": runs,
            "plans": {str(k): v for k, v in plans.items()}}


def _torch_version() -> str:
    import torch

    return torch.__version__


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _ckpt_markdown(results: list[dict], args, command: str) -> str:
    rows = []
    for res in results:
        for alloc in ALLOCATORS:
            off, on = res["runs"][f"{alloc}|False"], res["runs"][f"{alloc}|True"]
            m_off, m_on = _median(off, "measured_mb"), _median(on, "measured_mb")
            each = " / ".join(", ".join(f"{x['measured_mb']:.0f}" for x in runs) for runs in (off, on))
            rows.append(
                f"| {res['name']} | {alloc} | {res['positions']} | {res['batch']} x {res['seq']} | {len(off)} | {m_off:.0f} | {m_on:.0f} | "
                f"**{m_on / m_off:.3f}** | {_median(off, 'peak_mb'):.0f} / {_median(on, 'peak_mb'):.0f} | "
                f"{_median(off, 'seconds_per_step'):.1f} / {_median(on, 'seconds_per_step'):.1f} | {each} |"
            )
    return "\n".join([
        SECTION_CKPT, "",
        f"Command: `{command}`", "",
        f"One native block (copy init) grown at the given position, only it trains (`trainable={args.trainable!r}`, AdamW, fp32, "
        f"no prefix cache: every layer runs each step), {args.steps} optimizer step(s) per process on random tokens; {machine()}, "
        f"torch {_torch_version()}, {args.threads} torch thread(s), {time.strftime('%Y-%m-%d')}; a shared machine, so the "
        "s/step are loose. Each figure is one fresh process: peak resident memory of the training steps "
        "(`VmHWM` after resetting it once the trainer is set up) minus the process's resident memory after its imports "
        "(its interpreter and libraries); medians over the repeats, the two configurations alternating. Checkpointing "
        "recomputes the layers from the new block up in backward (`gradient_checkpointing=True`). Allocator "
        "`glibc default` is the process as shipped; `mmap >= 64 KiB` sets `MALLOC_MMAP_THRESHOLD_=65536`, so that every "
        "tensor buffer is mapped when allocated and unmapped when freed and the resident memory follows the live tensors "
        "(by default glibc raises that threshold to the largest buffer freed so far, up to 32 MiB, and keeps freed "
        "buffers below it in its heap, which the resident memory keeps counting).", "",
        "| model | allocator | positions | batch x seq | repeats | off: peak - baseline MiB | on: peak - baseline MiB | on / off | peak RSS off / on MiB | s/step off / on | each run off / on MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ])


def _plan_markdown(results: list[dict], command: str) -> str:
    rows = []
    for res in results:
        for key, label in (("False", "off"), ("True", "on")):
            plan, pred = res["plans"][key], res["plans"][key]["total_bytes"] / MiB
            shipped, live = (_median(res["runs"][f"{alloc}|{key}"], "measured_mb") for alloc in ALLOCATORS)
            measured = live
            rows.append(
                f"| {res['name']} | {label} | {res['batch']} x {res['seq']} | {plan['parameters'] / 1e6:.1f}M / {plan['trainable_parameters'] / 1e6:.2f}M | "
                f"{plan['parameter_bytes'] / MiB:.0f} | {plan['gradient_bytes'] / MiB:.0f} | {plan['optimizer_bytes'] / MiB:.0f} | "
                f"{plan['activation_bytes'] / MiB:.0f} | **{pred:.0f}** | **{measured:.0f}** | **{pred / measured:.3f}** | {shipped:.0f} | {pred / shipped:.3f} |"
            )
    return "\n".join([
        SECTION_PLAN, "",
        f"Command: `{command}` (the measured figures are the ones of the checkpointing section above, same run).", "",
        "`plan_memory` builds the grown model from its config on the meta device, picks the trainable set as the trainer "
        "does, and runs one forward on fake tensors under `saved_tensors_hooks` to see what autograd keeps "
        "(`hf_depthgrow/training/memory_plan.py`); no weight is read. Measured: peak resident memory of the training "
        "steps minus the process's resident memory after its imports, median over the repeats (see above). Both count "
        "the model, its gradients, AdamW's state and the activations; the measurement also holds allocator slack and "
        "the few MB of token rows. The planner predicts live tensor memory, which is what the `mmap >= 64 KiB` "
        "allocator's resident memory follows (and what `torch.cuda.max_memory_allocated` reports on a GPU); glibc's "
        "default heap keeps freed buffers and so shows more.", "",
        "| model | checkpointing | batch x seq | parameters / trainable | params MiB | grads MiB | AdamW MiB | activations MiB | predicted MiB | measured MiB (mmap >= 64 KiB) | predicted / measured | measured MiB (glibc default) | predicted / measured |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ])


def _replan(args, results: list[dict]) -> list[dict]:
    """The stored measurements with the planner's predictions made again (the planner reads only the configs)."""
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        Path(tmp, "config.json").write_text(json.dumps(LLAMA_1B))
        for res in results:
            source = "smollm2" if res["name"].startswith("SmolLM2") else tmp
            res["plans"] = {str(on): _predicted(source, res["positions"], on, res["batch"], res["seq"], args.trainable) for on in (False, True)}
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--positions", type=int, nargs="+", default=[15], help="SmolLM2 growth positions (30 layers)")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per process (the first allocates AdamW's state)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per configuration")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--trainable", default="new", choices=["new", "new+lora", "full"])
    parser.add_argument("--large", action="store_true", help="also the random ~1B Llama config (once, batch 1, --large-seq tokens)")
    parser.add_argument("--large-seq", type=int, default=512)
    parser.add_argument("--large-positions", type=int, nargs="+", default=[8])
    parser.add_argument("--write-results", action="store_true", help="write both tables into benchmarks/RESULTS.md")
    parser.add_argument("--json", default=None, help="also write the raw measurements to this file")
    parser.add_argument("--replan", default=None, help="a --json file of an earlier run: predict again with the planner as it is now")
    parser.add_argument("--measured-with", default=None, help="with --replan: the command that measured that file (when it does not say)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="smollm2", help=argparse.SUPPRESS)
    parser.add_argument("--gradient-checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    command = command_line("bench_memory.py", argv)
    if args.replan:
        results = _replan(args, json.loads(Path(args.replan).read_text()))
        command = f"{results[0].get('command') or args.measured_with}` (measured); `{command}"  # the planner's figures
    else:
        results = [_measure(args, "SmolLM2-135M", "smollm2", args.positions, args.batch, args.seq, args.repeats)]
        if args.large:
            with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
                Path(tmp, "config.json").write_text(json.dumps(LLAMA_1B))
                results.append(_measure(args, "Llama 1B shape, random", tmp, args.large_positions, 1, args.large_seq, 1))
                results[-1]["model"] = "config.json (Llama-3.2-1B shape)"
        for res in results:
            res["command"] = command
    text = _ckpt_markdown(results, args, command) + "\n\n" + _plan_markdown(results, command)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if args.write_results:
        write_section(HERE / "RESULTS.md", SECTION_CKPT, _ckpt_markdown(results, args, command))
        write_section(HERE / "RESULTS.md", SECTION_PLAN, _plan_markdown(results, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
