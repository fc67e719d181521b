"""Streaming continued pretraining: peak memory and tokens/s as the corpus grows 10x, against loading it whole.

    python benchmarks/bench_streaming.py --write-results

The corpus is the Python docs (Debian's python3.11-doc; Shakespeare where it is missing) written as JSON-lines
shards, at 1x and 10x its base size. Each run trains one new block of a small random Llama (4 layers x 64, a
byte-level tokenizer) through every block of the corpus once, so the 10x run trains 10x the steps:

- streamed: `hf_depthgrow.data.streaming.stream_data` (blocks tokenized as training reaches them);
- loaded: `hf_depthgrow.data.load_data` on the same folder (what a user would otherwise run: the corpus
  tokenized up front into a `datasets.Dataset` of blocks), then the same training.

Every run is a fresh process; peak memory is the kernel's `VmHWM` at the end (the whole process: load,
tokenize, train). tokens/s counts the training tokens over the process's CPU time (one thread; on a shared machine the wall clock
measures the other jobs too) of `train()` alone for the loaded runs and of `stream_data` + `train()` for the
streamed ones (the stream's check pass is part of its cost).
Medians over `--repeats` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from results_file import rerun_command, write_section  # noqa: E402

REPO = HERE.parent
SECTION = "## Streaming continued pretraining: memory as the corpus grows"
BLOCK, BATCH = 128, 8


def _corpus(folder: Path, chars: int) -> Path:
    from hf_depthgrow.data import python_docs_texts, shakespeare_texts

    try:
        texts = python_docs_texts()
    except (FileNotFoundError, ValueError):
        texts = shakespeare_texts()
    folder.mkdir(parents=True)
    written, shard = 0, 0
    while written < chars:
        with open(folder / f"shard-{shard:04d}.jsonl", "w") as f:
            for text in texts:
                piece = text[: chars - written]
                f.write(json.dumps({"text": piece}) + "\n")
                written += len(piece)
                if written >= chars:
                    break
        shard += 1
    return folder


def _peak_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _texts(corpus: Path) -> list[str]:
    return [json.loads(line)["text"] for shard in sorted(corpus.glob("*.jsonl")) for line in shard.read_text().splitlines()]


def worker(mode: str, corpus: str, tokenizer_dir: str, blocks: str) -> dict:
    import torch
    import transformers

    from hf_depthgrow import grow_depth, train
    from hf_depthgrow.testing import tiny_model

    torch.set_num_threads(1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    model = tiny_model("llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128)
    grow_depth(model, [2])
    n = int(blocks) // BATCH * BATCH  # every block of the corpus (counted by the driver), in whole batches
    start = time.process_time()
    if mode == "streamed":
        from hf_depthgrow.data import stream_data

        _, rows = stream_data(corpus, tokenizer, block_size=BLOCK, train_blocks=n, model=model)
    else:
        from hf_depthgrow.data import load_data

        rows = load_data(corpus, model=model, tokenizer=tokenizer, block_size=BLOCK)
        start = time.process_time()
    train(model, rows, max_steps=n // BATCH, per_device_train_batch_size=BATCH, fallback=False, progress_bar=False,
          prefix_cache="off", output_dir=tempfile.mkdtemp())
    seconds = time.process_time() - start
    return {"blocks": n, "tokens_per_s": n * BLOCK / seconds, "seconds": seconds, "peak_mb": _peak_mb()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-chars", type=int, default=200_000, help="characters of the 1x corpus")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write-results", action="store_true")
    parser.add_argument("--worker", nargs=4, metavar=("MODE", "CORPUS", "TOKENIZER", "BLOCKS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return 0
    from hf_depthgrow.data import causal_lm_blocks
    from hf_depthgrow.testing import byte_level_tokenizer

    tmp = Path(tempfile.mkdtemp(prefix="bench_streaming_"))
    corpora = {scale: _corpus(tmp / f"x{scale}", args.base_chars * scale) for scale in (1, 10)}
    tokenizer = byte_level_tokenizer(_texts(corpora[1]))
    tokenizer.save_pretrained(tmp / "tokenizer")
    # Counted here, outside the measured processes: both train through every block of the corpus once.
    counts = {scale: len(causal_lm_blocks(tokenizer, _texts(c), BLOCK)) for scale, c in corpora.items()}
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    results = {}
    # (corpus scale, mode, blocks trained): the third row streams the 10x corpus for the 1x run's steps, which
    # separates what grows with the corpus from what grows with the length of the run.
    cases = [(s, m, counts[s]) for s in corpora for m in ("loaded", "streamed")] + [(10, "streamed, 1x steps", counts[1])]
    for scale, mode, blocks in cases:
        runs = []
        for _ in range(args.repeats):
            command = [sys.executable, __file__, "--worker", mode.split(",")[0], str(corpora[scale]), str(tmp / "tokenizer"), str(blocks)]
            out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        results[(scale, mode)] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(scale, mode, results[(scale, mode)], flush=True)
    results[(1, "streamed, 1x steps")] = results[(1, "streamed")]
    rows = []
    for mode in ("loaded", "streamed", "streamed, 1x steps"):
        one, ten = results[(1, mode)], results[(10, mode)]
        rows.append(f"| {mode} | {one['blocks']:.0f} / {ten['blocks']:.0f} | {one['peak_mb']:.0f} | {ten['peak_mb']:.0f} | "
                    f"{ten['peak_mb'] / one['peak_mb']:.3f}x | {one['tokens_per_s']:.0f} | {ten['tokens_per_s']:.0f} | "
                    f"{ten['tokens_per_s'] / one['tokens_per_s']:.3f}x |")
    import torch

    text = "\n".join([
        SECTION, "",
        f"Command: `{rerun_command('bench_streaming.py', sys.argv[1:] if argv is None else argv)}`", "",
        f"Corpus: {args.base_chars:,} characters (1x) and {10 * args.base_chars:,} (10x) of text as JSON-lines shards; "
        f"one new block of a random Llama (4 layers x 64, byte-level tokenizer) trained once through every block of "
        f"{BLOCK} tokens, batch {BATCH}, one thread; torch {torch.__version__}, {os.cpu_count()} cores (shared with "
        f"other jobs: tokens/s is per CPU second of the process). Medians of {args.repeats} fresh processes each. 'loaded' is "
        "`load_data` on the folder then `train`; 'streamed' is `stream_data` (its check pass included) then `train`; "
        "'streamed, 1x steps' streams the 10x corpus for the 1x run's blocks only.", "",
        "| data | blocks 1x / 10x | peak RSS 1x MB | peak RSS 10x MB | 10x / 1x | tokens/s 1x | tokens/s 10x | 10x / 1x |",
        "|---|---|---|---|---|---|---|---|",
        *rows, "",
    ])
    print(text)
    if args.write_results:
        write_section(HERE / "RESULTS.md", SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
