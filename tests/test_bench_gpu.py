"""benchmarks/gpu.py runs on CPU with a tiny model, so the GPU benchmark cannot rot between runs on a GPU."""

import math
from pathlib import Path

import pytest
from bench_loader import load_benchmark

GPU_BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.py"


@pytest.fixture(scope="module")
def gpu_bench():
    return load_benchmark(GPU_BENCH)


ARGS = ["--model", "tiny", "--steps", "2", "--warmup", "0", "--seq", "16", "--batch", "2", "--examples", "4", "--probe-batches", "1"]


def test_gpu_benchmark_measures_every_variant_and_writes_tagged_rows(gpu_bench, tmp_path):
    results_md = tmp_path / "RESULTS.md"
    results_md.write_text("# Benchmark results\n\n## Another section\n\nkept as it is\n")
    results = gpu_bench.main([*ARGS, "--write-results", "--results", str(results_md)])

    by_variant = {r["variant"]: r for r in results}
    assert set(by_variant) == {"new", "new+cache", "lora", "full", "probe (all positions)", "evaluation (paired)"}
    for r in results:
        assert r["tokens_per_s"] > 0 and math.isfinite(r["tokens_per_s"])
    # The frozen base: new blocks and LoRA train a small share of what full fine-tuning trains.
    assert by_variant["new"]["trainable"] == by_variant["new+cache"]["trainable"] < by_variant["full"]["trainable"]
    assert by_variant["lora"]["trainable"] < by_variant["full"]["trainable"]
    # The cache skips the prefix forward, so torch counts fewer FLOPs for the cached step.
    assert by_variant["new+cache"]["flops_per_step"] < by_variant["new"]["flops_per_step"]

    text = results_md.read_text()
    assert "## Another section\n\nkept as it is" in text
    section = text.split(gpu_bench.SECTION, 1)[1]
    rows = [ln for ln in section.splitlines() if ln.startswith("| CPU")]
    assert len(rows) == 6 and all("| tiny | fp32 | 16 x 2 |" in ln for ln in rows)
    assert "1.00x" in next(ln for ln in rows if "| full |" in ln)

    # A rerun on the same device and model replaces its rows and its run line instead of adding more.
    gpu_bench.main([*ARGS, "--variants", "full", "--write-results", "--results", str(results_md)])
    section = results_md.read_text().split(gpu_bench.SECTION, 1)[1]
    assert len([ln for ln in section.splitlines() if ln.startswith("| CPU")]) == 3
    assert len([ln for ln in section.splitlines() if ln.startswith("- run: ")]) == 1
    assert str(tmp_path) not in section  # the run line names no local path

    # Another shape on the same device and model adds its rows beside the first shape's (a regression: it replaced them).
    gpu_bench.main([*ARGS, "--variants", "full", "--seq", "8", "--write-results", "--results", str(results_md)])
    section = results_md.read_text().split(gpu_bench.SECTION, 1)[1]
    rows = [ln for ln in section.splitlines() if ln.startswith("| CPU")]
    assert len([ln for ln in rows if "| 16 x 2 |" in ln]) == 3 and len([ln for ln in rows if "| 8 x 2 |" in ln]) == 3
    assert len([ln for ln in section.splitlines() if ln.startswith("- run: ")]) == 2


def test_gpu_benchmark_rejects_bad_sizes_before_loading(gpu_bench):
    with pytest.raises(SystemExit) as err:
        gpu_bench.main(["--model", "tiny", "--steps", "0"])
    assert err.value.code == 2


@pytest.mark.real_model
def test_smollm2_random_has_the_real_models_config(gpu_bench):
    # `--model smollm2-random` stands in for SmolLM2 where its weights cannot go: the same shapes, so the same work.
    from hf_depthgrow import load_model

    real = load_model("smollm2")[0].config
    for key, value in gpu_bench.SMOLLM2_135M.items():
        assert getattr(real, key) == value, key
    stand_in = gpu_bench.load_base(gpu_bench.argparse.Namespace(model="smollm2-random", examples=2, seq=8))[0]
    assert sum(p.numel() for p in stand_in.parameters()) == sum(p.numel() for p in load_model("smollm2")[0].parameters())


def test_growth_at_scale_variants_train_checkpointed_and_on_a_4bit_base_beside_the_planner(gpu_bench):
    pytest.importorskip("bitsandbytes")
    results = gpu_bench.main([*ARGS, "--variants", "new", "new+ckpt", "new+4bit"])
    by = {r["variant"]: r for r in results if "trainable" in r}
    # The same new block trains in every variant; only how its activations and the frozen base are held differs.
    assert by["new"]["trainable"] == by["new+ckpt"]["trainable"] == by["new+4bit"]["trainable"] > 0
    assert all(r["planned_mb"] > 0 for r in by.values())
    assert by["new+ckpt"]["planned_mb"] <= by["new"]["planned_mb"]  # checkpointing keeps fewer activations
    assert by["new+4bit"]["planned_mb"] < by["new"]["planned_mb"]  # a 4-bit base holds fewer weight bytes
    # Recomputation shows in the counted FLOPs: the checkpointed step runs the forward of the grown layers twice.
    assert by["new+ckpt"]["flops_per_step"] > by["new"]["flops_per_step"]
