"""Produce the example report in this folder: SmolLM2-135M grown at k = 15, trained briefly on Shakespeare,
evaluated against the original on held-out Shakespeare blocks (shared prefix), with Route A/B terms.

    python docs/examples/eval_smollm2/run_example.py

CPU only, offline; 78 minutes on a 2-core machine shared with other jobs (sizes chosen for that budget). Every number in report.json comes from this script.
"""

from __future__ import annotations

import copy
import math
import sys
import time
import warnings
from pathlib import Path

import torch

from hf_depthgrow import grow_depth, stepping_stone, train
from hf_depthgrow.data import load_data, load_smollm2, split_dataset
from hf_depthgrow.evaluation import evaluate_delta, route_inputs, write_report

K, BLOCK, EXAMPLES, STEPS, LR, BATCH = 15, 128, 160, 20, 3e-4, 4
STONE_BATCHES = 4  # batches of BATCH examples for each stepping stone's direction and line search (CPU budget)
FRACTIONS = {"train": 0.4, "held_out": 0.2, "test": 0.4}
OUT = Path(__file__).resolve().parent


def main() -> int:
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.manual_seed(0)
    started = time.time()
    model, tok = load_smollm2()
    data = load_data("shakespeare", model=model, tokenizer=tok, block_size=BLOCK, max_examples=EXAMPLES)
    splits = split_dataset(data, FRACTIONS, seed=0)
    train_ds, held_out, test = splits["train"], splits["held_out"], splits["test"]
    print({k: len(v) for k, v in splits.items()}, flush=True)

    # f~_S (direction from the training split) for the fallback rule, f~_pop (direction from held-out) for Route A.
    stone_s, info_s = stepping_stone(model, K, train_ds, block="native", batch_size=BATCH, max_batches=STONE_BATCHES)
    stone_pop, info_pop = stepping_stone(model, K, train_ds, direction_data=held_out, block="native", batch_size=BATCH,
                                         max_batches=STONE_BATCHES)
    print("stepping stones", info_s.eta, info_s.loss_old, info_s.loss_stone, info_pop.eta, info_pop.loss_stone, flush=True)

    grown = grow_depth(copy.deepcopy(model), [K], block="native")
    result = train(grown, train_ds, eval_data=held_out, stepping_stone=(stone_s, info_s), max_steps=STEPS,
                   learning_rate=LR, per_device_train_batch_size=BATCH, lr_scheduler="constant",
                   save_final_model=False, progress_bar=False, logging_steps=5)
    print("trained", result.selected, result.train_losses, result.delta_erm, flush=True)
    f_new = result.model

    inputs = route_inputs(f_new, n_train=len(train_ds), train_result=result, stone_pop=stone_pop, held_out=held_out,
                          stone=stone_s, test_data=test, block_data=train_ds, batch_size=BATCH)
    # B: chosen before looking at the test data: ln(vocabulary), the loss of a uniform predictor. Cross-entropy
    # has no a-priori bound; per-example losses above B are clipped for Hoeffding/Bernstein (the report counts them).
    bound = math.log(model.config.vocab_size)
    evaluation = evaluate_delta(f_new, test, loss_bound=bound, routes=inputs, batch_size=BATCH, progress=True)
    evaluation.models["old"]["name_or_path"] = "SmolLM2-135M-Instruct (grown model, new block bypassed)"
    evaluation.models["new"]["name_or_path"] = f"SmolLM2-135M-Instruct + native block at k={K}, trained {STEPS} steps"
    extra = {
        "model": "SmolLM2-135M-Instruct (hf_depthgrow.embedded.load_smollm2, fp32), 30 layers",
        "growth": f"one native block at k = {K} (copy of layer {K - 1}, residual outputs zeroed)",
        "data": f"{EXAMPLES} Shakespeare blocks of {BLOCK} tokens, split {FRACTIONS} with seed 0",
        "training": f"hf_depthgrow.trainer.train: {STEPS} steps, batch {BATCH}, AdamW lr {LR} constant, new block only; "
                    f"selected = {result.selected}, train losses {result.train_losses}",
        "stepping stones": f"directions and line searches on {STONE_BATCHES} batches of {BATCH}; f~_S eta={info_s.eta:.4g} (L_S {info_s.loss_old:.4f} -> {info_s.loss_stone:.4f}); "
                           f"f~_pop eta={info_pop.eta:.4g} (direction from held-out, L_S -> {info_pop.loss_stone:.4f})",
        "loss bound": f"B = ln({model.config.vocab_size}) = {bound:.4f}, fixed before evaluation",
        "runtime": f"{time.time() - started:.0f} s on CPU",
    }
    command = "python docs/examples/eval_smollm2/run_example.py"
    write_report(evaluation, OUT, title="SmolLM2-135M grown at k = 15: paired evaluation on held-out Shakespeare",
                 command=command, extra=extra)
    print(evaluation.verdict)
    return 0


if __name__ == "__main__":
    sys.exit(main())
