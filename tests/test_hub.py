"""Pushing grown models, offline, against the fake Hub of `fake_hub.py` on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import ModelCard, constants

from hf_depthgrow import grow_depth, save_pretrained
from hf_depthgrow.hub.push import HubUnreachableError, push_model_to_hub, push_to_hub
from hf_depthgrow.hub.model_card import CardInfo, render_model_card, validate_card_metadata
from hf_depthgrow.hub.serialization import ADAPTER_CONFIG, ADAPTER_WEIGHTS, MARKER
from hf_depthgrow.testing import tiny_model

sys.path.insert(0, str(Path(__file__).parent))  # fake_hub.py sits beside this file, whatever pytest's import mode
from fake_hub import FakeHub, use_fake_hub_env  # noqa: E402

TOKEN = "hf_fake_token_for_tests"
BASE = "HuggingFaceTB/SmolLM2-135M"


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[PAD]": 1, **{f"w{i}": i + 2 for i in range(30)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]")


@pytest.fixture(scope="module")
def grown_llama():
    model = tiny_model("llama")
    grow_depth(model, [2])
    return model


@pytest.fixture(scope="module")
def adapter_bert():
    model = tiny_model("bert")
    grow_depth(model, [1], block="adapter")
    return model


@pytest.fixture(scope="module")
def tokenizer():
    return _tokenizer()


def _hub_env(monkeypatch):
    use_fake_hub_env(monkeypatch, TOKEN)


@pytest.fixture(params=["regular", "lfs"])
def hub(request, monkeypatch):
    """The fake Hub; `lfs`: safetensors go through the LFS batch API, as the Hub's .gitattributes makes them."""
    _hub_env(monkeypatch)
    huggingface_hub.close_session()  # a fresh client that sees NO_PROXY
    with FakeHub(lfs_patterns=("*.safetensors",) if request.param == "lfs" else ()) as fake:
        fake.mode = request.param
        yield fake
    huggingface_hub.close_session()  # drop keep-alive sockets to the stopped server


@pytest.fixture
def plain_hub(monkeypatch):
    _hub_env(monkeypatch)
    huggingface_hub.close_session()
    with FakeHub() as fake:
        yield fake
    huggingface_hub.close_session()


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _report_files(folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    files = {
        "report.json": json.dumps({"delta": 0.01, "intervals": {"bernstein": [-0.1, 0.2]}}, indent=2),
        "report.md": "# Paired evaluation\n\n**Verdict:** no certified difference.\n",
        "eval_intervals.png": b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4,  # binary, not text
    }
    out = {}
    for name, content in files.items():
        path = folder / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        out[name] = path
    return out


def _assert_card(text: str, *, library_name: str, base_model: str, model_type: str) -> ModelCard:
    meta = validate_card_metadata(text)  # offline Hub rules: parses, round-trips, right types
    card = ModelCard(text)
    assert card.data.base_model == base_model
    assert card.data.library_name == library_name
    assert {"hf_depthgrow", "depth-growth", model_type} <= set(card.data.tags)
    assert meta["library_name"] == library_name
    return card


# --------------------------------------------------------------------------- uploads


def test_push_folder_uploads_every_file_byte_for_byte(hub, grown_llama, tokenizer, tmp_path):
    folder = tmp_path / "grown"
    save_pretrained(grown_llama, folder, tokenizer=tokenizer)
    render_model_card(CardInfo.from_model(grown_llama, base_model=BASE, repo_id="me/grown-llama")).save(folder / "README.md")
    for name, src in _report_files(tmp_path / "report").items():
        (folder / name).write_bytes(src.read_bytes())
    on_disk = _tree(folder)
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md", "report.json", "report.md"} <= set(on_disk)

    url = push_to_hub(folder, "me/grown-llama", endpoint=hub.endpoint)

    assert url.startswith(f"{hub.endpoint}/me/grown-llama/commit/")
    assert list(hub.repos) == ["me/grown-llama"]
    assert hub.files("me/grown-llama") == on_disk  # every file, exactly the bytes on disk
    assert hub.unexpected == []
    # The token came from HF_TOKEN, resolved by huggingface_hub, on every request that carries one.
    assert hub.tokens() == {TOKEN}
    writes = [r for r in hub.requests if r.path.startswith(("/api/repos", "/api/models"))]
    assert writes and all(r.headers.get("authorization") == f"Bearer {TOKEN}" for r in writes)
    assert hub.validated_yaml, "huggingface_hub validates README.md metadata before uploading"
    lfs_calls = [r for r in hub.requests if r.path.endswith("/info/lfs/objects/batch")]
    assert bool(lfs_calls) == (hub.mode == "lfs")
    _assert_card(hub.files("me/grown-llama")["README.md"].decode(), library_name="transformers", base_model=BASE, model_type="llama")


def test_push_model_to_hub_saves_card_and_report_files(plain_hub, grown_llama, tokenizer, tmp_path):
    report = _report_files(tmp_path / "report")
    extra = {"report.json": report["report.json"], "report.md": report["report.md"], "plots/eval_intervals.png": report["eval_intervals.png"]}
    card = {"license": "apache-2.0", "config": {"grow": {"positions": [2]}}, "datasets": ["stanfordnlp/imdb", str(tmp_path)]}

    url = push_model_to_hub(
        grown_llama, "me/grown", tokenizer=tokenizer, card=card, extra_files=extra, base_model=BASE,
        endpoint=plain_hub.endpoint, commit_message="grown at k=2",
    )

    uploaded = plain_hub.files("me/grown")
    reference = tmp_path / "reference"
    save_pretrained(grown_llama, reference, tokenizer=tokenizer)  # the same save, done here
    for name, data in _tree(reference).items():
        assert uploaded[name] == data, name
    for name, src in extra.items():
        assert uploaded[name] == src.read_bytes(), name
    assert set(uploaded) == set(_tree(reference)) | set(extra) | {"README.md"}
    assert url == f"{plain_hub.endpoint}/me/grown/commit/{plain_hub.commits('me/grown')[-1]['oid']}"
    assert plain_hub.commits("me/grown")[-1]["summary"] == "grown at k=2"
    readme = _assert_card(uploaded["README.md"].decode(), library_name="transformers", base_model=BASE, model_type="llama")
    assert readme.data.license == "apache-2.0"
    assert readme.data.datasets == ["stanfordnlp/imdb"]  # the local path stays in the text
    assert str(tmp_path) not in readme.text and tmp_path.name in readme.text  # local paths: by name only
    assert "growth" in readme.text.lower()


def test_adapters_only_push_uploads_only_the_adapter_files(plain_hub, adapter_bert, tmp_path):
    base = "google-bert/bert-base-uncased"
    push_model_to_hub(adapter_bert, "me/bert-adapters", adapters_only=True, base_model=base, endpoint=plain_hub.endpoint)

    uploaded = plain_hub.files("me/bert-adapters")
    assert set(uploaded) == {ADAPTER_WEIGHTS, ADAPTER_CONFIG, "README.md", MARKER}
    reference = save_pretrained(adapter_bert, tmp_path / "ref", adapters_only=True, base_model=base)
    assert uploaded[ADAPTER_WEIGHTS] == (reference / ADAPTER_WEIGHTS).read_bytes()
    assert uploaded[ADAPTER_CONFIG] == (reference / ADAPTER_CONFIG).read_bytes()
    card = _assert_card(uploaded["README.md"].decode(), library_name="hf_depthgrow", base_model=base, model_type="bert")
    assert card.data.to_dict()["base_model_relation"] == "adapter"
    assert "load_pretrained" in card.text and "adapter block on layer 1" in card.text


def test_push_to_a_branch_and_as_pull_request(plain_hub, grown_llama, tmp_path):
    folder = save_pretrained(grown_llama, tmp_path / "grown")
    push_to_hub(folder, "me/m", endpoint=plain_hub.endpoint, revision="grown-k2", private=True)
    assert plain_hub.files("me/m", "grown-k2") == _tree(folder)
    assert plain_hub.files("me/m", "main") == {}
    assert plain_hub.repos["me/m"].private is True
    push_to_hub(folder, "me/m", endpoint=plain_hub.endpoint, create_pr=True)
    assert plain_hub.files("me/m", "refs/pr/1") == _tree(folder)
    with pytest.raises(ValueError, match="create_pr"):
        push_to_hub(folder, "me/m", endpoint=plain_hub.endpoint, create_pr=True, revision="grown-k2")


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("repo_id", [None, "", "   ", "a/b/c", "bad name"])
def test_no_push_without_a_valid_repo_id(plain_hub, grown_llama, tmp_path, repo_id):
    folder = save_pretrained(grown_llama, tmp_path / "grown")
    with pytest.raises(ValueError, match="repo_id"):
        push_to_hub(folder, repo_id, endpoint=plain_hub.endpoint)
    with pytest.raises(ValueError, match="repo_id"):
        push_model_to_hub(grown_llama, repo_id, endpoint=plain_hub.endpoint)
    assert plain_hub.requests == []


def test_repo_id_without_namespace_is_refused_before_any_request(plain_hub, grown_llama, tmp_path):
    folder = save_pretrained(grown_llama, tmp_path / "grown")
    expected = r"^repo_id 'grown' has no namespace: pass 'namespace/name', e.g. 'your-name/grown'$"
    with pytest.raises(ValueError, match=expected):
        push_to_hub(folder, "grown", token=TOKEN, endpoint=plain_hub.endpoint)
    with pytest.raises(ValueError, match=expected):
        push_model_to_hub(grown_llama, "grown", token=TOKEN, endpoint=plain_hub.endpoint)
    assert plain_hub.requests == []


@pytest.mark.parametrize("pickle_name", ["pytorch_model.bin", "training_args.bin", "sub/optimizer.pt", "extra.pkl", "x.pickle"])
def test_folder_with_pickle_files_is_refused(plain_hub, grown_llama, tmp_path, pickle_name):
    folder = save_pretrained(grown_llama, tmp_path / "grown")
    (folder / pickle_name).parent.mkdir(parents=True, exist_ok=True)
    (folder / pickle_name).write_bytes(b"\x80\x04K\x01.")  # a pickle of the int 1
    with pytest.raises(ValueError, match="pickle"):
        push_to_hub(folder, "me/m", endpoint=plain_hub.endpoint)
    assert plain_hub.requests == []


def test_folder_that_is_not_a_saved_model_is_refused(plain_hub, tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ValueError, match="config.json"):
        push_to_hub(tmp_path, "me/m", endpoint=plain_hub.endpoint)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="safetensors"):
        push_to_hub(tmp_path, "me/m", endpoint=plain_hub.endpoint)
    with pytest.raises(ValueError, match="not a folder"):
        push_to_hub(tmp_path / "missing", "me/m", endpoint=plain_hub.endpoint)
    assert plain_hub.requests == []


def test_readme_with_invalid_metadata_is_refused_offline(plain_hub, grown_llama, tmp_path):
    folder = save_pretrained(grown_llama, tmp_path / "grown")
    (folder / "README.md").write_text("---\nbase_model: /home/me/models/base\ntags: depth\n---\n# card\n")
    with pytest.raises(ValueError, match="base_model") as err:
        push_to_hub(folder, "me/m", endpoint=plain_hub.endpoint)
    assert "tags" in str(err.value)
    assert plain_hub.requests == []


def test_extra_files_must_not_replace_saved_files(plain_hub, grown_llama, tmp_path):
    other = tmp_path / "config.json"
    other.write_text("{}")
    with pytest.raises(ValueError, match="replace"):
        push_model_to_hub(grown_llama, "me/m", extra_files={"config.json": other}, endpoint=plain_hub.endpoint)
    with pytest.raises(ValueError, match="relative"):
        push_model_to_hub(grown_llama, "me/m", extra_files={"../x.json": other}, endpoint=plain_hub.endpoint)
    assert plain_hub.requests == []


def test_no_token_is_a_clear_error(plain_hub, grown_llama, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))  # no `hf auth login` token either
    folder = save_pretrained(grown_llama, tmp_path / "grown")
    with pytest.raises(ValueError, match="HF_TOKEN"):
        push_to_hub(folder, "me/m", endpoint=plain_hub.endpoint)
    assert plain_hub.requests == []
    push_to_hub(folder, "me/m", endpoint=plain_hub.endpoint, token="hf_explicit")  # an explicit token is used as is
    assert plain_hub.tokens() == {"hf_explicit"}


def test_unreachable_hub_names_the_endpoint_and_how_to_change_it(grown_llama, tmp_path, monkeypatch):
    _hub_env(monkeypatch)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder = save_pretrained(grown_llama, tmp_path / "grown")
    endpoint = f"http://127.0.0.1:{port}"
    with pytest.raises(HubUnreachableError, match="unreachable") as err:
        push_to_hub(folder, "me/m", endpoint=endpoint)
    assert endpoint in str(err.value) and "HF_ENDPOINT" in str(err.value) and "endpoint=" in str(err.value)


def test_offline_mode_is_a_clear_error(plain_hub, grown_llama, tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    folder = save_pretrained(grown_llama, tmp_path / "grown")
    with pytest.raises(HubUnreachableError, match="HF_HUB_OFFLINE"):
        push_to_hub(folder, "me/m", endpoint=plain_hub.endpoint)
    assert plain_hub.requests == []
