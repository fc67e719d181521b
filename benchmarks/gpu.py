"""Training, probe and evaluation throughput on one accelerator: tokens/s, model FLOP utilisation, peak memory.

    python benchmarks/gpu.py --write-results                       # SmolLM2-135M, bf16 on a GPU
    python benchmarks/gpu.py --model tiny --steps 3 --warmup 1     # CPU smoke run (what CI runs)
    python benchmarks/gpu.py --model smollm2-random --write-results  # SmolLM2-135M's architecture, random weights
    python benchmarks/gpu.py --model llama-1b-random --seq 2048 --batch 4 --steps 5 --warmup 2 \
        --variants new new+ckpt new+4bit full --probe-batches 1 --write-results   # growth at 1B, under 8 minutes

`smollm2-random` is for a machine the SmolLM2 weights cannot reach (its 98 MB GGUF is over what travels to a
lent GPU machine): SmolLM2-135M's exact config with random weights and random token ids. Step time, FLOPs and
memory depend on the shapes, not on the values, so its rows measure the same work (its losses mean nothing).

Four ways to train SmolLM2 for the same steps, the first three leaving the base frozen:

- `new`:        one native block at k (copy init) trains alone, full forward + backward (LLaMA Pro);
- `new+cache`:  the same with this trainer's frozen-prefix cache (layers below k run once, up front);
- `lora`:       LoRA (r=8) on every linear layer of the ungrown model;
- `full`:       every parameter of the ungrown model trains: the baseline a user would otherwise run;
- `new+ckpt`:   `new` with gradient checkpointing (`TrainConfig.gradient_checkpointing`);
- `new+4bit`:   `new` on a base saved and reloaded in 4-bit NF4 (`load_model(..., quantize="4bit")`, bitsandbytes).

`llama-1b-random` is Llama-3.2-1B's shape (16 layers x 2048, vocab 128,256) with random weights, the size at which
the recipes switch checkpointing on. Each training row also gives the memory planner's prediction for the same arm
(`hf_depthgrow.training.plan_memory`: parameters, gradients, AdamW state and activations), next to the measured peak.

Each variant gets a fresh model and a `GrownTrainer`; after `--warmup` steps, `--steps` steps are
timed one by one (CUDA synchronised) and the median step time gives tokens/s. FLOPs per step come
from torch's `FlopCounterMode` on one extra step (matmuls and the attention kernels, forward and backward; torch's SDPA
formulas are given grouped-query attention's keys and values at the query's head count, and the CPU flash kernel,
which torch has no formula for, the same formulas).
MFU = counted FLOPs per second / the device's dense peak (`--peak-tflops`, or the table below).
Peak memory: `torch.cuda.max_memory_allocated` over the timed steps on CUDA; on CPU the kernel's
peak RSS over the timed steps (`VmHWM` after `clear_refs`), which also counts the model itself.
Then the probe (all positions) and the paired evaluation of a grown model run over the same data
(`--probe-batches` batches), timed as a whole.

Rows go to benchmarks/RESULTS.md under "GPU benchmark", tagged by device; a rerun on the same
device and model replaces its rows.
"""

from __future__ import annotations

import argparse
import copy
import gc
import re
import statistics
import sys
import time
import warnings
from datetime import date
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the shared RESULTS.md helpers next to this script
from flops import flop_counter  # noqa: E402
from results_file import rerun_command, write_atomic  # noqa: E402
SECTION = "## GPU benchmark: training, probe and evaluation throughput"
HEADER = (
    "| device | model | dtype | seq x batch | variant | trainable params | tokens/s | vs full | MFU | peak memory MB | planner MB | FLOPs counted per token |\n"
    "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"
)
# Dense bf16 peaks in TFLOP/s (vendor datasheets, without sparsity).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0, "RTX 4090": 165.0}
VARIANTS = ("new", "new+cache", "lora", "full", "new+ckpt", "new+4bit")
DEFAULT_VARIANTS = VARIANTS[:4]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"CPU {platform.machine()} ({torch.get_num_threads()} threads)"


def peak_tflops(name: str, override: float | None) -> float | None:
    if override:
        return override
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


# SmolLM2-135M-Instruct's config (what `load_model("smollm2").config` holds; tests/test_bench_gpu.py checks it).
SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, hidden_act="silu", max_position_embeddings=8192, rms_norm_eps=9.999999747378752e-06,
    tie_word_embeddings=True, rope_parameters={"rope_theta": 100000.0, "rope_type": "default"}, attention_bias=False,
    mlp_bias=False, pad_token_id=2, bos_token_id=1, eos_token_id=2,
)


# Llama-3.2-1B's shape (rope scaling left at the default: the shapes, not the positions, set time and memory).
LLAMA_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-05,
    tie_word_embeddings=True, rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}, attention_bias=False,
    mlp_bias=False, bos_token_id=128000, eos_token_id=128001,
)


def load_base(args):
    """The model to benchmark (fp32 weights; bf16 comes from autocast) and its training rows."""
    if args.model in ("tiny", "smollm2-random", "llama-1b-random"):
        if args.model == "tiny":
            from hf_depthgrow.testing import tiny_model

            model = tiny_model("llama", num_hidden_layers=6, hidden_size=64, intermediate_size=128, vocab_size=512)
        else:
            from transformers import LlamaConfig, LlamaForCausalLM

            torch.manual_seed(0)
            shape = SMOLLM2_135M if args.model == "smollm2-random" else LLAMA_1B
            model = LlamaForCausalLM(LlamaConfig(**shape)).eval()
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(2, model.config.vocab_size, (args.examples, args.seq), generator=g)
        rows = [{"input_ids": r, "attention_mask": torch.ones_like(r), "labels": r.clone()} for r in ids]
        return model, rows
    from hf_depthgrow import load_model
    from hf_depthgrow.data import load_data

    model, tokenizer = load_model("smollm2")
    rows = load_data("shakespeare", model=model, tokenizer=tokenizer, block_size=args.seq, max_examples=args.examples)
    return model, rows


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _status_mb(key: str) -> float | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    match = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
    return int(match.group(1)) / 1024 if match else None


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    except OSError:
        pass


def _peak_mb(device: torch.device) -> float | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return _status_mb("VmHWM")


def quantized_copy(base):
    """`base` as a user loads a 4-bit base: saved, then reloaded through `BitsAndBytesConfig` (NF4)."""
    import tempfile

    from hf_depthgrow import load_model

    with tempfile.TemporaryDirectory() as folder:
        base.save_pretrained(folder)
        model, _ = load_model(folder, quantize="4bit")
    return model


def planned_mb(base, variant: str, args, precision: str) -> float | None:
    """The memory planner's prediction for `variant` (per device, MiB); `None` for an arm it has no model of (LoRA
    without growth; the prefix cache, which it does not count)."""
    from hf_depthgrow.training import PlanSettings, plan_memory

    if variant in ("lora", "new+cache"):
        return None
    trainable = "full" if variant == "full" else "new"
    settings = PlanSettings(positions=[args.k], trainable=trainable, seq=args.seq, batch=args.batch,
                            gradient_checkpointing=variant == "new+ckpt", quantize="4bit" if variant == "new+4bit" else None,
                            dtype="bfloat16" if precision == "bf16" else "float32")
    return plan_memory(base.config, settings).total_bytes / 2**20


def make_trainer(base, rows, variant: str, args, precision: str):
    """A set-up `GrownTrainer` for `variant` on a fresh copy of `base`."""
    from hf_depthgrow import grow_depth
    from hf_depthgrow.training import GrownTrainer, TrainConfig

    model = quantized_copy(base) if variant == "new+4bit" else copy.deepcopy(base)
    if variant.startswith("new"):
        grow_depth(model, [args.k], block="native", init="copy")
    cfg = TrainConfig(
        trainable="new" if variant.startswith("new") else variant,
        prefix_cache="memory" if variant == "new+cache" else "off", gradient_checkpointing=variant == "new+ckpt",
        max_steps=10_000, per_device_train_batch_size=args.batch, learning_rate=1e-4, fallback=False,
        mixed_precision=precision, progress_bar=False, seed=0, lora_r=8,
    )
    trainer = GrownTrainer(model, cfg, rows)
    trainer.setup()
    return trainer


def measure_training(base, rows, variant: str, args, precision: str, device: torch.device) -> dict:
    trainer = make_trainer(base, rows, variant, args, precision)
    step = 0
    for _ in range(args.warmup):
        step += 1
        trainer.training_step(step)
    _sync(device)
    gc.collect()
    _reset_peak(device)
    times = []
    for _ in range(args.steps):
        step += 1
        _sync(device)
        t0 = time.perf_counter()
        out = trainer.training_step(step)
        _sync(device)
        times.append(time.perf_counter() - t0)
        if not torch.isfinite(torch.tensor(out["loss"])):
            raise RuntimeError(f"{variant}: non-finite loss {out['loss']} at step {step}")
    peak = _peak_mb(device)
    with flop_counter() as counter:
        step += 1
        trainer.training_step(step)
    tokens = args.batch * args.seq
    trainable = sum(p.numel() for _, p in trainer.trainable_named)
    for cache in (trainer.train_cache, trainer.eval_cache):
        if cache is not None:
            cache.close()
    del trainer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    median = statistics.median(times)
    return {
        "variant": variant,
        "trainable": trainable,
        "tokens_per_s": tokens / median,
        "step_seconds": [round(t, 4) for t in times],
        "flops_per_step": counter.get_total_flops(),
        "peak_mb": peak,
        "planned_mb": planned_mb(base, variant, args, precision),
    }


def measure_probe_and_eval(base, rows, args, device: torch.device) -> list[dict]:
    """Probe throughput (all positions) and paired-evaluation throughput, in tokens/s."""
    from hf_depthgrow import grow_depth, probe
    from hf_depthgrow.evaluation import evaluate_delta

    data = rows[: args.batch * args.probe_batches]
    tokens = len(data) * args.seq
    model = copy.deepcopy(base).to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    out = []
    with autocast:
        _sync(device)
        t0 = time.perf_counter()
        probe(model, data, batch_size=args.batch, progress=False)
        _sync(device)
        out.append({"variant": "probe (all positions)", "tokens_per_s": tokens / (time.perf_counter() - t0)})
        grow_depth(model, [args.k], block="native", init="copy")
        _sync(device)
        t0 = time.perf_counter()
        with warnings.catch_warnings():  # the data-derived loss bound: throughput is measured here, not intervals
            warnings.filterwarnings("ignore", message="loss_bound not given")
            evaluate_delta(model, data, batch_size=args.batch, n_bootstrap=200, metrics=False, use_evaluate=False)
        _sync(device)
        out.append({"variant": "evaluation (paired)", "tokens_per_s": tokens / (time.perf_counter() - t0)})
    return out


def rows_markdown(results: list[dict], args, device_tag: str, dtype: str, peak: float | None) -> list[str]:
    """One table row per result; training rows carry the ratio to `full`, MFU and peak memory."""
    full = next((r["tokens_per_s"] for r in results if r["variant"] == "full"), None)
    lead = f"| {device_tag} | {args.model} | {dtype} | {args.seq} x {args.batch} |"
    lines = []
    for r in results:
        if "trainable" not in r:  # probe / evaluation: throughput only
            lines.append(f"{lead} {r['variant']} |  | {r['tokens_per_s']:,.0f} |  |  |  |  |  |")
            continue
        per_token = r["flops_per_step"] / (args.batch * args.seq)
        ratio = f"{r['tokens_per_s'] / full:.2f}x" if full else ""
        mfu = f"{100 * per_token * r['tokens_per_s'] / (peak * 1e12):.1f}%" if peak else "n/a"
        memory = f"{r['peak_mb']:,.0f}" if r["peak_mb"] is not None else "n/a"
        planned = f"{r['planned_mb']:,.0f}" if r.get("planned_mb") is not None else "n/a"
        lines.append(
            f"{lead} {r['variant']} | {r['trainable']:,} | {r['tokens_per_s']:,.0f} | {ratio} | {mfu} | {memory} | {planned} | "
            f"{per_token / 1e6:,.2f} M |"
        )
    return lines


def write_results(path: Path, lines: list[str], device_tag: str, model: str, shape: str, command: str) -> None:
    """Put `lines` in the section's table, replacing earlier rows (and the run line) of the same device, model and
    `seq x batch` shape; rows of other shapes stay."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    if SECTION not in text:
        text = text.rstrip() + f"\n\n{SECTION}\n\nCommand: see each row's run below. Written by `benchmarks/gpu.py`.\n\n{HEADER}\n"
    head, rest = text.split(SECTION, 1)
    nxt = rest.find("\n## ")
    body, tail = (rest, "") if nxt < 0 else (rest[:nxt], rest[nxt:])
    row_key, run_key = f"| {device_tag} | {model} | ", f"- run: `{device_tag}`, {model}, {shape}, "
    keep = [ln for ln in body.splitlines() if not (ln.startswith(row_key) and f" | {shape} | " in ln) and not ln.startswith(run_key)]
    table_end = max(i for i, ln in enumerate(keep) if ln.startswith("|")) + 1
    keep[table_end:table_end] = lines
    keep.append(f"{run_key}{date.today().isoformat()}: `{command}`")
    write_atomic(path, head + SECTION + "\n".join(keep).rstrip() + "\n" + tail)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["smollm2", "smollm2-random", "llama-1b-random", "tiny"], default="smollm2")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--examples", type=int, default=64)
    p.add_argument("--k", type=int, default=None, help="where the new block goes (default: the middle)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant (median)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--probe-batches", type=int, default=4)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(DEFAULT_VARIANTS))
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak (default: table)")
    p.add_argument("--write-results", action="store_true", help="write rows into benchmarks/RESULTS.md")
    p.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    args = p.parse_args(argv)
    for name in ("seq", "batch", "examples", "steps", "probe_batches"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = "bf16" if device.type == "cuda" else "no"
    base, rows = load_base(args)
    args.k = args.k if args.k is not None else base.config.num_hidden_layers // 2
    if len(rows) < args.batch:
        p.error(f"--examples {len(rows)} gives fewer rows than one batch ({args.batch})")
    results = [measure_training(base, rows, v, args, precision, device) for v in args.variants]
    results += measure_probe_and_eval(base, rows, args, device)
    tag = device_name(device)
    lines = rows_markdown(results, args, tag, "bf16" if precision == "bf16" else "fp32", peak_tflops(tag, args.peak_tflops))
    print("\n".join([HEADER, *lines]))
    if args.write_results:
        shape = f"{args.seq} x {args.batch}"
        write_results(args.results, lines, tag, args.model, shape, rerun_command("gpu.py", sys.argv[1:] if argv is None else argv))
    return results


if __name__ == "__main__":
    main()
