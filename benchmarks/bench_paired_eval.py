"""Shared-prefix paired evaluation vs two separate full evaluations, on the real SmolLM2-135M.

    python benchmarks/bench_paired_eval.py --k 15 --blocks 2 --block-size 256 --batch-size 2 --repeats 21 --threads 1

SmolLM2-135M (30 layers) gets one native block at k (default 15). Each repeat times, in the same
process and on the same held-out Shakespeare blocks:
- shared: `evaluate_delta(grown, ...)`: prefix (layers 0..k-1) once per batch, then the grown
  suffix and the original suffix (inside `bypass_new_blocks`);
- separate: `compare_models(original, grown, ...)`: both models run fully.
The order alternates between repeats, and the ratio is taken per repeat (shared / separate of the
same repeat), so slow drifts of a shared machine cancel; medians are reported. Short runs (one
batch each) and many repeats keep both halves of a pair under the same load. Both the process
CPU time (`time.process_time`, robust when other jobs share the cores; with `--threads 1` it is
the compute itself) and the wall-clock time are measured. Next to it: the ratio a matmul-FLOP
count predicts from the config at the sequence length used, and a calibrated prediction: the
same layer count with the measured CPU time of one layer and of head + per-example loss.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
import warnings

import torch


def layer_flops(config, seq: int, causal: bool = True) -> float:
    """Matmul FLOPs per token of one decoder layer (2 per multiply-add).

    Projections q, k, v, o and the gated MLP (gate, up, down), plus the attention matmuls
    QK^T and AV: with a causal kernel a query at position t attends to t + 1 keys, (seq + 1)/2 on average.
    """
    d = config.hidden_size
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", heads)
    hd = getattr(config, "head_dim", None) or d // heads
    proj = 2 * d * (heads * hd) * 2 + 2 * d * (kv * hd) * 2  # q and o; k and v
    mlp = 2 * d * config.intermediate_size * 3
    keys = (seq + 1) / 2 if causal else seq
    attn = 2 * 2 * heads * hd * keys  # QK^T and AV
    return proj + mlp + attn


def head_flops(config) -> float:
    return 2 * config.hidden_size * config.vocab_size


def predicted_ratio(config, k: int, seq: int, causal: bool = True) -> dict:
    L, lay, head = config.num_hidden_layers, layer_flops(config, seq, causal), head_flops(config)
    separate = (L * lay + head) + ((L + 1) * lay + head)
    shared = k * lay + (L + 1 - k) * lay + (L - k) * lay + 2 * head
    return {"ratio": shared / separate, "head_in_layers": head / lay, "layer_flops_per_token": lay,
            "head_flops_per_token": head, "shared_flops_per_token": shared, "separate_flops_per_token": separate}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, default=15)
    p.add_argument("--blocks", type=int, default=2, help="held-out Shakespeare blocks per timed run")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: CPU time = compute)")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)

    from hf_depthgrow import grow_depth
    from hf_depthgrow.data import causal_lm_blocks, load_smollm2, shakespeare_texts
    from hf_depthgrow.evaluation import compare_models, evaluate_delta

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    loaded, tok = load_smollm2()
    # Both models as in-memory copies: weights that from_pretrained left memory-mapped would make the
    # baseline pay page faults that the grown (copied) model does not.
    original = copy.deepcopy(loaded)
    grown = grow_depth(copy.deepcopy(loaded), [args.k], block="native")
    del loaded
    # The last blocks of the corpus stream, as held-out examples; labels = inputs.
    ids = causal_lm_blocks(tok, shakespeare_texts(max_chars=200_000), args.block_size)[-args.blocks:]
    data = [{"input_ids": r, "attention_mask": torch.ones_like(r), "labels": r.clone()} for r in ids]
    kwargs = dict(loss_bound=20.0, n_bootstrap=200, metrics=False, batch_size=args.batch_size)

    def timed(fn):
        w, c = time.perf_counter(), time.process_time()
        r = fn()
        return (time.process_time() - c, time.perf_counter() - w), r

    def run_shared():
        return timed(lambda: evaluate_delta(grown, data, **kwargs))

    def run_separate():
        return timed(lambda: compare_models(original, grown, data, **kwargs))

    load_start = os.getloadavg()
    from hf_depthgrow.losses import example_losses

    batch = {k: torch.stack([row[k] for row in data[: args.batch_size]]) for k in data[0]}

    def components() -> tuple[float, float]:
        """CPU seconds of one layer (body / L) and of head + per-example loss, on one batch."""
        with torch.no_grad():
            c = time.process_time()
            hidden = original.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
            body = time.process_time() - c
            c = time.process_time()
            example_losses(original.lm_head(hidden), batch["labels"], causal=True)
            head = time.process_time() - c
        return body / original.config.num_hidden_layers, head

    def calibrated(layer: float, head: float) -> float:
        L, k = original.config.num_hidden_layers, args.k
        return ((2 * L + 1 - k) * layer + 2 * head) / ((2 * L + 1) * layer + 2 * head)

    run_shared(), run_separate(), components()  # warm-up (allocator, kernels)
    calib = []
    shared_t, sep_t, ratios, wall_ratios, max_diff = [], [], [], [], 0.0
    for rep in range(args.repeats):
        order = (run_shared, run_separate) if rep % 2 == 0 else (run_separate, run_shared)
        res = {}
        for fn in order:
            res[fn.__name__] = fn()
        calib.append(components())
        (ts, rs), (tp, rp) = res["run_shared"], res["run_separate"]
        shared_t.append(ts[0]), sep_t.append(tp[0]), ratios.append(ts[0] / tp[0]), wall_ratios.append(ts[1] / tp[1])
        for a, b in ((rs.per_example_old, rp.per_example_old), (rs.per_example_new, rp.per_example_new)):
            max_diff = max(max_diff, max(abs(x - y) for x, y in zip(a, b)))
        print(f"repeat {rep}: CPU shared {ts[0]:.2f}s separate {tp[0]:.2f}s ratio {ts[0] / tp[0]:.3f}; "
              f"wall {ts[1]:.2f}s / {tp[1]:.2f}s = {ts[1] / tp[1]:.3f}", flush=True)
    pred = predicted_ratio(original.config, args.k, args.block_size)
    pred_full = predicted_ratio(original.config, args.k, args.block_size, causal=False)
    measured = statistics.median(ratios)
    out = {
        "model": "SmolLM2-135M-Instruct (fp32, 30 layers)",
        "k": args.k,
        "examples": args.blocks,
        "block_size": args.block_size,
        "batch_size": args.batch_size,
        "repeats": args.repeats,
        "median_shared_cpu_s": statistics.median(shared_t),
        "median_separate_cpu_s": statistics.median(sep_t),
        "cpu_ratios": ratios,
        "median_ratio": measured,
        "wall_ratios": wall_ratios,
        "median_wall_ratio": statistics.median(wall_ratios),
        "wall_relative_error": statistics.median(wall_ratios) / pred["ratio"] - 1,
        "ratio_of_medians": statistics.median(shared_t) / statistics.median(sep_t),
        "ratio_of_minima": min(shared_t) / min(sep_t),
        "ratio_quartiles": statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios,
        "predicted_ratio": pred["ratio"],
        "predicted_ratio_noncausal_attention": pred_full["ratio"],
        "head_in_layers": pred["head_in_layers"],
        "measured_layer_cpu_s": statistics.median(c[0] for c in calib),
        "measured_head_and_loss_cpu_s": statistics.median(c[1] for c in calib),
        "measured_head_and_loss_in_layers": statistics.median(c[1] / c[0] for c in calib),
        "calibrated_ratio": statistics.median(calibrated(*c) for c in calib),
        "relative_error": measured / pred["ratio"] - 1,
        "max_abs_diff_per_example_loss": max_diff,
        "torch_threads": torch.get_num_threads(),
        "loadavg_at_start": load_start,
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "loadavg_at_end": os.getloadavg(),
    }
    print(json.dumps(out, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    raise SystemExit(main())
