"""Sharded HF checkpoints in the megatron trainer: lazy per-rank loading and sharded export.

References: the eager conversion of the whole checkpoint (``convert.hf_to_megatron`` of every
tensor, then ``split_tp`` and ``pipeline.select_stage``), which tests/test_megatron_convert.py
and tests/test_megatron_tp.py check against HF logits and the single-rank actor; and
transformers' own ``save_pretrained(max_shard_size=…)`` / ``from_pretrained``.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip(
    "megatron.core", reason="megatron-core not installed (pip install '.[megatron]')"
)
pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning:megatron.*", "ignore::DeprecationWarning:megatron.*"
)

from sat_cli.models import hf_checkpoint  # noqa: E402
from sat_cli.trainers.megatron import convert, hf_io, pipeline  # noqa: E402

CAP = 1_000_000  # bytes: the tiny model (4.1 MB) in five shards


@pytest.fixture(scope="module")
def sharded_dir(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded") / "model"
    hf_checkpoint.save_hf_checkpoint(convert.load_hf_state(tiny_dir), out, tiny_dir, CAP)
    return out


def _eager(src_dir, cfg, ep_rank, ep, tp_rank, tp, stage):
    full = convert.hf_to_megatron(convert.load_hf_state(src_dir), cfg, ep_rank=ep_rank, ep_size=ep)
    state = convert.split_tp(full, tp_rank, tp)
    return state if stage is None else pipeline.select_stage(state, *stage)


# (ep, tp, pipeline stage: layers, first, last)
LAYOUTS = [(2, 1, None), (1, 2, None), (2, 2, None), (1, 1, (range(2, 4), False, True))]


@pytest.mark.parametrize("which", ["single", "sharded"])
def test_lazy_rank_state_is_the_slice_of_the_full_state(tiny_dir, sharded_dir, which):
    src = tiny_dir if which == "single" else sharded_dir
    cfg = convert.read_hf_config(src)
    for ep, tp, stage in LAYOUTS:
        for ep_rank in range(ep):
            for tp_rank in range(tp):
                reader = hf_io.CheckpointReader(src)
                plan = hf_io.rank_plan(
                    reader, cfg, ep_rank=ep_rank, ep_size=ep, tp_rank=tp_rank, tp_size=tp
                )
                if stage is not None:
                    plan = pipeline.select_stage(plan, *stage)
                lazy = {k: f() for k, f in plan.items()}
                ref = _eager(src, cfg, ep_rank, ep, tp_rank, tp, stage)
                assert set(lazy) == set(ref)
                for k in ref:
                    assert torch.equal(lazy[k], ref[k]), (ep, tp, ep_rank, tp_rank, k)


def test_fused_expert_layout_reads_only_owned_experts(tiny_dir, tmp_path):
    cfg = convert.read_hf_config(tiny_dir)
    state = convert.load_hf_state(tiny_dir)
    fused = {}
    for k, t in state.items():
        if ".mlp.experts." not in k:
            fused[k] = t
    for layer in range(cfg["num_hidden_layers"]):
        h = f"model.layers.{layer}.mlp.experts."
        e = range(cfg["num_experts"])
        fused[h + "gate_up_proj"] = torch.stack(
            [
                torch.cat([state[f"{h}{i}.gate_proj.weight"], state[f"{h}{i}.up_proj.weight"]])
                for i in e
            ]
        )
        fused[h + "down_proj"] = torch.stack([state[f"{h}{i}.down_proj.weight"] for i in e])
    out = tmp_path / "fused"
    hf_checkpoint.save_hf_checkpoint(fused, out, tiny_dir, CAP)
    reader = hf_io.CheckpointReader(out)
    plan = hf_io.rank_plan(reader, cfg, ep_rank=1, ep_size=2)
    lazy = {k: f() for k, f in plan.items()}
    ref = _eager(tiny_dir, cfg, 1, 2, 0, 1, None)
    assert set(lazy) == set(ref) and all(torch.equal(lazy[k], ref[k]) for k in ref)
    expert_elems = sum(n for k, n in reader.read_log if ".mlp.experts." in k)
    all_experts = sum(t.numel() for k, t in fused.items() if ".mlp.experts." in k)
    assert expert_elems * 2 == all_experts  # half the experts, nothing else of those tensors


@pytest.mark.parametrize("ep,tp,stage", LAYOUTS)
def test_lazy_load_reads_only_the_owned_tensors(sharded_dir, ep, tp, stage):
    """Every element read belongs to the rank's state, and nothing is read twice."""
    cfg = convert.read_hf_config(sharded_dir)
    reader = hf_io.CheckpointReader(sharded_dir)
    plan = hf_io.rank_plan(reader, cfg, ep_rank=ep - 1, ep_size=ep, tp_rank=tp - 1, tp_size=tp)
    if stage is not None:
        plan = pipeline.select_stage(plan, *stage)
    assert reader.read_log == []  # planning reads headers only
    owned = sum(f().numel() for f in plan.values())
    keys = [k for k, _ in reader.read_log]
    assert len(keys) == len(set(keys))
    assert sum(n for _, n in reader.read_log) == owned
    total = sum(t.numel() for t in convert.load_hf_state(sharded_dir).values())
    if ep == 2:  # the other rank's experts are never touched
        assert not any(".mlp.experts.0." in k or ".mlp.experts.3." in k for k in keys)
        assert any(".mlp.experts.7." in k for k in keys)
    if stage is not None:
        assert not any(k.startswith(("model.layers.0.", "model.layers.1.")) for k in keys)
        assert "model.embed_tokens.weight" not in keys
    print(f"ep={ep} tp={tp} stage={stage}: read {owned} of {total} elements")
    ref = _eager(sharded_dir, cfg, ep - 1, ep, tp - 1, tp, stage)
    assert owned == sum(t.numel() for t in ref.values()) < total
    # bytes from disk: exactly the owned tensors, plus under tp the other half of each o_proj
    # (columns are read with their rows, then sliced)
    o_proj = cfg["hidden_size"] * cfg["num_attention_heads"] * cfg["head_dim"]
    extra = 0 if tp == 1 else cfg["num_hidden_layers"] * o_proj // 2
    assert reader.bytes_read == 4 * (owned + extra)


def test_sharded_export_is_transformers_layout(tiny_dir, sharded_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from sat_cli.models.tiny_moe import build_tiny_moe, load_model
    from sat_cli.models.weights_check import check_hf_dir

    files = sorted(p.name for p in sharded_dir.glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00005.safetensors" for i in range(1, 6)]
    index = json.loads((sharded_dir / hf_io.INDEX_NAME).read_text())
    # transformers' own sharded save of the same weights: the same index, byte for byte
    ref_dir = tmp_path / "ref"
    build_tiny_moe(seed=3).save_pretrained(ref_dir, max_shard_size=CAP)
    ref = json.loads((ref_dir / hf_io.INDEX_NAME).read_text())
    assert index["metadata"] == ref["metadata"]
    assert set(index["weight_map"]) == set(ref["weight_map"])
    assert set(index["weight_map"].values()) == set(files)
    src = convert.load_hf_state(tiny_dir)
    back = convert.load_hf_state(sharded_dir)
    assert set(back) == set(src) and all(torch.equal(back[k], src[k]) for k in src)
    # every reader of published weights: the pre-load check, transformers, the local engine's
    # and local trainer's loader (load_model, also used by the engine's update_weights)
    check_hf_dir(sharded_dir, "weights")
    hf = AutoModelForCausalLM.from_pretrained(sharded_dir)
    ours = load_model(sharded_dir)
    orig = load_model(tiny_dir)
    ids = torch.randint(3, 40, (2, 9))
    with torch.no_grad():
        want = orig(ids).logits
        assert torch.equal(hf(ids).logits, want)
        assert torch.equal(ours(ids).logits, want)


def test_shard_size_parsing():
    assert hf_checkpoint.parse_size("5GB") == hf_checkpoint.DEFAULT_MAX_SHARD_SIZE == 5 * 10**9
    assert hf_checkpoint.parse_size("500MB") == 5 * 10**8
    assert hf_checkpoint.parse_size("2GiB") == 2 << 30
    assert hf_checkpoint.parse_size(1234) == 1234
    for bad in ("lots", "0", -1, "5 parsecs"):
        with pytest.raises(ValueError):
            hf_checkpoint.parse_size(bad)


def test_config_checks_the_shard_size():
    from sat_cli.trainers.megatron.settings import MegatronTrainerSettings as TrainerConfig
    from sat_cli.validate import ConfigError

    assert TrainerConfig(max_shard_size="500MB").max_shard_size == "500MB"
    with pytest.raises(ConfigError, match="trainer.max_shard_size"):
        TrainerConfig(max_shard_size="lots")


def test_reader_reads_every_dtype_like_safetensors(tmp_path):
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, generator=g)
    tensors = {
        "bf16": x.bfloat16(),
        "f16": x.half(),
        "f64": x.double(),
        "i64": torch.arange(12).view(3, 4),
        "mask": x > 0,
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    want = load_file(str(tmp_path / "model.safetensors"))
    reader = hf_io.CheckpointReader(tmp_path)
    for k, t in want.items():
        got = reader.get(k)
        assert got.dtype == t.dtype and torch.equal(got, t), k
    assert torch.equal(reader.get("bf16", slice(2, 4)), want["bf16"][2:4])
    assert torch.equal(reader.get("f16", (slice(None), slice(1, 3))), want["f16"][:, 1:3])
