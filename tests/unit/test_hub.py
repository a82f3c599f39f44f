"""Hub ids for model directories: an offline Hub cache laid out on disk, errors, one download per node."""

from __future__ import annotations

import httpx
import huggingface_hub
import pytest
from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

from colocate import hub
from tests.distributed import run_ranks
from tests.helpers import write_hf_model
from tests.real_models import lay_out_hub_repo, offline_hub


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("Qwen/Qwen2.5-0.5B-Instruct", True),
        ("meta-llama/Llama-3.1-8B@main", True),
        ("a/b@v1.0", True),
        ("org/name@0123abc", True),
        ("/abs/model", False),
        ("model", False),
        ("a/b/c", False),
        ("./a/b", False),
        ("~/models/x", False),
        ("a/../b", False),
        ("a/b@", False),
    ],
)
def test_repo_id_shape(spec, expected):
    assert hub.is_repo_id(spec) is expected


def test_local_directories_pass_and_missing_ones_are_named(tmp_path):
    model, _ = write_hf_model(tmp_path, "qwen2")
    assert hub.resolve_model(str(model), "model.path") == str(model)
    with pytest.raises(ValueError, match=rf"^--model: model directory {tmp_path}/nope does not exist$"):
        hub.resolve_model(str(tmp_path / "nope"), "--model")
    with pytest.raises(ValueError, match=r"^model.path: .*config.json is a file, not a model directory$"):
        hub.resolve_model(str(model / "config.json"), "model.path")


def test_repo_id_resolves_to_the_cached_snapshot_offline(tmp_path, monkeypatch):
    model, _ = write_hf_model(tmp_path, "qwen3")
    cache = tmp_path / "hub"
    snap = lay_out_hub_repo(cache, "acme/tiny-qwen3", model)
    offline_hub(monkeypatch, cache)
    assert hub.resolve_model("acme/tiny-qwen3", "model.path") == str(snap)
    assert hub.resolve_model("acme/tiny-qwen3@main", "model.path") == str(snap)
    with pytest.raises(ValueError) as e:
        hub.resolve_model("acme/other", "model.ref_path")
    assert str(e.value) == (f"model.ref_path: the Hub model acme/other is not in the cache {cache}, and HF_HUB_OFFLINE is set")
    with pytest.raises(ValueError, match=r"the Hub model acme/tiny-qwen3@v2 is not in the cache"):
        hub.resolve_model("acme/tiny-qwen3@v2", "model.path")


def _raising(error):
    def fake(repo_id, **kwargs):
        assert kwargs["allow_patterns"] == hub.MODEL_FILES and kwargs["local_files_only"] is False
        raise error

    return fake


def test_errors_say_not_found_gated_or_unreachable(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    response = httpx.Response(401, request=httpx.Request("GET", "https://hub.invalid/api/models/x/y"))
    cases = [
        (
            RepositoryNotFoundError("404", response=response),
            "model.path: x/y is not a local path, and the Hub has no model repository x/y (a private one needs HF_TOKEN)",
        ),
        (
            GatedRepoError("403", response=response),
            "model.path: the Hub model x/y is gated: accept its conditions on its Hub page, then set HF_TOKEN to "
            "a token of that account",
        ),
        (
            LocalEntryNotFoundError("connection"),
            f"model.path: the Hub model x/y is not in the cache {tmp_path}, and the Hub could not be reached",
        ),
    ]
    for error, message in cases:
        monkeypatch.setattr(huggingface_hub, "snapshot_download", _raising(error))
        with pytest.raises(ValueError) as e:
            hub.resolve_model("x/y", "model.path")
        assert str(e.value) == message


def _download_on_local_rank_zero(rank, world_size, tmp_path):
    marker = tmp_path / "downloaded"

    def fetch(local_only):
        assert local_only == (rank != 0)
        if local_only:  # the others read only once local rank 0 has finished
            assert marker.read_text() == "done"
        else:
            marker.write_text("done")
        return [f"{rank}:{local_only}"]

    assert hub.fetch_once_per_node(fetch, local_rank=rank) == [f"{rank}:{rank != 0}"]

    def failing(local_only):
        raise ValueError("model.path: the Hub model x/y is gated")

    with pytest.raises(ValueError) as e:
        hub.fetch_once_per_node(failing, local_rank=rank)
    assert str(e.value) == (
        "model.path: the Hub model x/y is gated"
        if rank == 0
        else "the download from the Hugging Face Hub failed on another process (its error says why)"
    )


def test_one_process_per_node_downloads_the_others_wait(tmp_path):
    run_ranks(_download_on_local_rank_zero, 2, tmp_path)
