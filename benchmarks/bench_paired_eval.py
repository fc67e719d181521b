"""Shared-prefix paired evaluation vs two separate full evaluations, on the real SmolLM2-135M.

    python benchmarks/bench_paired_eval.py --k 15 --blocks 8 --block-size 256 --batch-size 4 --repeats 7

SmolLM2-135M (30 layers) gets one native block at k (default 15). Each repeat times, in the same
process and on the same held-out Shakespeare blocks:
- shared: `evaluate_delta(grown, ...)`: prefix (layers 0..k-1) once per batch, then the grown
  suffix and the original suffix (inside `bypass_new_blocks`);
- separate: `compare_models(original, grown, ...)`: both models run fully.
The order alternates between repeats, and the ratio is taken per repeat (shared / separate of the
same repeat), so slow drifts of a shared machine cancel; medians are reported. Next to it: the
ratio a matmul-FLOP count predicts from the config at the sequence length used.
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
    p.add_argument("--blocks", type=int, default=8, help="held-out Shakespeare blocks per timed run")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)

    from hf_depthgrow import grow_depth
    from hf_depthgrow.embedded import causal_lm_blocks, load_smollm2, shakespeare_texts
    from hf_depthgrow.evaluate import compare_models, evaluate_delta

    torch.manual_seed(0)
    original, tok = load_smollm2()
    grown = grow_depth(copy.deepcopy(original), [args.k], block="native")
    # The last blocks of the corpus stream, as held-out examples; labels = inputs.
    ids = causal_lm_blocks(tok, shakespeare_texts(max_chars=400_000), args.block_size)[-args.blocks:]
    data = [{"input_ids": r, "attention_mask": torch.ones_like(r), "labels": r.clone()} for r in ids]
    kwargs = dict(loss_bound=20.0, n_bootstrap=200, metrics=False, batch_size=args.batch_size)

    def run_shared():
        t = time.perf_counter()
        r = evaluate_delta(grown, data, **kwargs)
        return time.perf_counter() - t, r

    def run_separate():
        t = time.perf_counter()
        r = compare_models(original, grown, data, **kwargs)
        return time.perf_counter() - t, r

    run_shared(), run_separate()  # warm-up (allocator, kernels)
    shared_t, sep_t, ratios, max_diff = [], [], [], 0.0
    for rep in range(args.repeats):
        order = (run_shared, run_separate) if rep % 2 == 0 else (run_separate, run_shared)
        res = {}
        for fn in order:
            res[fn.__name__] = fn()
        (ts, rs), (tp, rp) = res["run_shared"], res["run_separate"]
        shared_t.append(ts), sep_t.append(tp), ratios.append(ts / tp)
        for a, b in ((rs.per_example_old, rp.per_example_old), (rs.per_example_new, rp.per_example_new)):
            max_diff = max(max_diff, max(abs(x - y) for x, y in zip(a, b)))
        print(f"repeat {rep}: shared {ts:.2f}s separate {tp:.2f}s ratio {ts / tp:.3f}", flush=True)
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
        "median_shared_s": statistics.median(shared_t),
        "median_separate_s": statistics.median(sep_t),
        "ratios": ratios,
        "median_ratio": measured,
        "ratio_of_medians": statistics.median(shared_t) / statistics.median(sep_t),
        "predicted_ratio": pred["ratio"],
        "predicted_ratio_noncausal_attention": pred_full["ratio"],
        "head_in_layers": pred["head_in_layers"],
        "relative_error": measured / pred["ratio"] - 1,
        "max_abs_diff_per_example_loss": max_diff,
        "torch_threads": torch.get_num_threads(),
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
