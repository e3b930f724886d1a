"""Hub ids resolve to snapshots of a local Hugging Face cache (``sat_cli/models/hub.py``), built
here in the cache's own layout under a temporary HF_HOME; no network."""

from __future__ import annotations

import shutil

import pytest

from sat_cli.errors import UserError
from sat_cli.models import hub
from sat_cli.models.tiny_moe import build_char_tokenizer, build_tiny_moe, save_hf

SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def fake_cache(tmp_path, monkeypatch):
    """``<cache>/models--org--tiny/snapshots/<SHA>/`` holding a tiny model, refs/main -> SHA."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    model = save_hf(build_tiny_moe(0), build_char_tokenizer(), tmp_path / "model")
    shutil.copytree(model, repo / "snapshots" / SHA)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hub_id_resolves_to_its_cached_snapshot_and_is_recorded(fake_cache):
    from sat_cli.build.parts import model_path
    from sat_cli.config import load

    _, obj = load(["model=qwen3_0_6b", "model.path=org/tiny"])
    lines = []
    path = model_path(obj, log=lines.append)
    assert path == str(fake_cache / "models--org--tiny" / "snapshots" / SHA)
    assert any(f"revision {SHA}" in line for line in lines)
    assert hub.source_tags(path) == {"model.hub_id": "org/tiny", "model.revision": SHA}
    assert hub.source_tags(str(fake_cache)) == {}


def test_missing_hub_id_offline_is_refused_naming_the_fetch_command(fake_cache):
    from sat_cli.build.parts import model_path
    from sat_cli.config import load

    _, obj = load(["model=qwen3_0_6b", "model.path=org/absent", "model.revision=v2"])
    with pytest.raises(UserError) as info:
        model_path(obj)
    msg = str(info.value)
    assert "\n" not in msg and "HF_HUB_OFFLINE is set" in msg
    assert "`sat model fetch org/absent --revision v2`" in msg
    _, obj = load(["model=qwen3_0_6b", "model.path=org/tiny", "model.revision=other"])
    with pytest.raises(UserError, match="sat model fetch org/tiny --revision other"):
        model_path(obj)  # the repo is cached, that revision is not


def test_bad_revision_is_refused_at_compose_time():
    from sat_cli.config import ConfigError, load

    with pytest.raises(ConfigError, match="model.revision"):
        load(["model=qwen3_0_6b", "model.revision=a b"])


def test_fetch_command_refuses_bad_input_in_one_line(sat_cli, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    for args, needle in ((["../x"], "is not a hub id"), (["a/b"], "needs the network")):
        out = sat_cli("model", "fetch", *args, cwd=tmp_path)
        assert out.returncode == 2 and needle in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
