"""`sat plan` / `sat train --dry-run`: the layout, parameter counts and the per-GPU memory table
against hand calculations; impossible layouts refused with exit 2 naming the key (also at
compose time); layouts the Megatron worker cannot run yet refused by `sat train` before anything
starts (sat_cli/trainers/megatron/layout.py, sat_cli/config/layout.py)."""

from __future__ import annotations

import json
import math
import re

import pytest
from cli_helpers import run_sat

from sat_cli.config import ConfigError, load
from sat_cli.models.arch import QWEN3_8B, QWEN3_30B_A3B, TINY_MOE_CONFIG, Arch
from sat_cli.trainers.megatron.layout import NOT_YET, Layout, params_per_gpu, unimplemented

PAPER = "experiment=paper_qwen3_30b_a3b"

# Qwen3-30B-A3B by hand (hidden 2048, 48 layers, 32 q / 4 kv heads of 128, 128 experts of 768,
# vocab 151936, untied):
ATTN = 2048 * (32 + 2 * 4) * 128 + 32 * 128 * 2048  # q, k, v + o = 18,874,368
NORMS_ROUTER = 2 * 2048 + 2 * 128 + 128 * 2048  # 2 RMSNorms, q/k norms, router = 266,496
EXPERT = 3 * 2048 * 768  # gate, up, down = 4,718,592
EMB = 151936 * 2048  # 311,164,928 (embedding; the output layer is as large)
PAPER_TOTAL = 48 * (ATTN + NORMS_ROUTER + 128 * EXPERT) + 2 * EMB + 2048  # + final norm
# per GPU with TP4 / EP4 / etp 1: attention and embeddings ÷ 4, norms and router whole, 32 experts
PAPER_DENSE = 48 * (ATTN // 4 + NORMS_ROUTER) + 2 * EMB // 4 + 2048
PAPER_EXPERT = 48 * 32 * EXPERT


def _plan(*args: str, cwd) -> str:
    out = run_sat("plan", *args, cwd=cwd)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    return out.stdout


UNITS = {"GB": 1e9, "MB": 1e6, "kB": 1e3}


def _row(text: str, name: str, process: str = "megatron rank") -> float:
    """A part's printed size in GB in ``process``'s block of the memory section ("peak": its
    peak)."""
    block = re.split(r"\n  (?=\S)", text.split(f"\n  {process}")[1])[0]
    if name == "peak":
        m = re.search(r"peak ([\d.]+) (GB|MB|kB)", block)
    else:
        m = re.search(rf"^    {name}\s+(?:([\d.]+) (GB|MB|kB)|(0))\s", block, re.M)
    assert m, block
    return 0.0 if m.group(1) is None else float(m.group(1)) * UNITS[m.group(2)] / 1e9


def test_hand_counts_match_the_table():
    assert PAPER_TOTAL == 30_532_122_624  # ≈ 30.5 B, the model card's figure
    arch = Arch.from_hf(QWEN3_30B_A3B)
    assert arch.total() == PAPER_TOTAL
    lay = Layout(
        1,
        4,
        tp=4,
        pp=1,
        cp=1,
        ep=4,
        etp=1,
        dtype="bfloat16",
        optimizer_offload=True,
        recompute=True,
    )
    assert params_per_gpu(arch, lay) == (PAPER_DENSE, PAPER_EXPERT)
    # pp 2: half the layers and one of embedding / output layer on the largest stage
    lay2 = Layout(
        1,
        8,
        tp=4,
        pp=2,
        cp=1,
        ep=4,
        etp=1,
        dtype="bfloat16",
        optimizer_offload=False,
        recompute=False,
    )
    dense, expert = params_per_gpu(arch, lay2)
    assert dense == 24 * (ATTN // 4 + NORMS_ROUTER) + EMB // 4 + 2048
    assert expert == PAPER_EXPERT // 2


def test_tiny_model_count_equals_the_hf_model():
    """The tiny default's parameters, counted by transformers on the built model and by hand."""
    from sat_cli.models.tiny_moe import build_tiny_moe

    hf = sum(p.numel() for p in build_tiny_moe(0).parameters())
    # hidden 128, 4 layers, 4 q / 2 kv heads of 32, 8 experts of 64, vocab 128, untied
    attn = 128 * (4 + 2 * 2) * 32 + 4 * 32 * 128  # 49,152
    per_layer = attn + (2 * 128 + 2 * 32 + 8 * 128) + 8 * 3 * 128 * 64  # + norms, router, experts
    by_hand = 4 * per_layer + 2 * 128 * 128 + 128
    assert hf == by_hand == 1_021_312
    assert Arch.from_hf(TINY_MOE_CONFIG).total() == hf


def test_plan_paper_overlay_fits_80_and_141_gb(tmp_path):
    text = _plan(PAPER, cwd=tmp_path)
    assert "30,532,122,624 (30.53 B) parameters" in text
    assert "sglang: 1 server(s) × tp 4 × dp 1 (ep 4) = 4 GPUs" in text
    assert "1 node(s) × 4 processes = 4 ranks" in text and "tp 4, pp 1, cp 1, ep 4, etp 1" in text
    assert (
        "GPUs      4 rollout + 4 training, disjoint (engine.colocate=false): node 0 needs 8" in text
    )
    assert (
        "  node 0     sglang server 0   GPU 0,1,2,3      cuda, bfloat16; CUDA_VISIBLE_DEVICES=0,1,2,3"
        in text
    )
    assert (
        "  node 0     megatron node 0   GPU 4,5,6,7      cuda, bfloat16; CUDA_VISIBLE_DEVICES=4,5,6,7"
        in text
    )
    n = PAPER_DENSE + PAPER_EXPERT  # 7,642,626,048 per trainer GPU
    # the job's CPUs and host memory, by hand: sat train 1 + SGLang (2 + tp 4) + 4 ranks; 11
    # processes × 2 GB, the bf16 model once for the engine and once for the trainer node, the
    # offloaded fp32 main weights and Adam moments (12 B/param) of each of the 4 ranks; × 1.2
    total = 30_532_122_624
    parts = 11 * 2.0 + 2 * total / 1e9 + 2 * total / 1e9 + 4 * 12 * n / 1e9
    assert (
        "requests  a sweep job (--executor slurm|ray): 1 node, 8 GPU(s), 11 CPUs (1 sat train + "
        f"6 engine + 4 Megatron ranks), {math.ceil(parts * 1.2)} GB host memory" in text
    )
    assert f"{n:,} (dense {PAPER_DENSE:,}, experts {PAPER_EXPERT:,})" in text
    assert _row(text, "weights") == round(2 * n / 1e9, 2)  # bf16: 15.29
    assert _row(text, "gradients") == round(4 * n / 1e9, 2)  # fp32 main grads: 30.57
    assert _row(text, "optimizer states") == 0.0  # offloaded ...
    assert f"host memory: {12 * n / 1e9:.2f} GB per GPU (offloaded)" in text  # ... 91.71 GB
    # 1024 prompt + 8192 response tokens (the preset's cap: a 33,792-token row does not fit)
    assert "1 × 9216 tokens ÷ tp 4, full recompute" in text
    assert _row(text, "attention scores") == round(9216**2 * 8 * (6 + 8) / 1e9, 2)  # 8 heads
    assert _row(text, "logits") == round(18 * 9216 * 151936 / 4 / 1e9, 2)  # vocab shard ÷ tp 4
    # MoE dispatch: 9216 tokens gathered over ep 4 (2h each), 8/4 experts' share through 2h + 3f
    moe = (2 * 9216 * 2048 + 9216 * 2 * (2 * 2048 + 3 * 768)) * 2 + 4 * 9216 * 128
    assert _row(text, "MoE dispatch") == pytest.approx(moe / 1e9, abs=1e-4)  # 0.316
    # peak: weights + gradients + layer inputs + one layer + scores and MoE buffers (they
    # outweigh the vocabulary shard's logits) + overhead
    inputs = 9216 * 2048 * 2 * 48 / 4  # each layer's input, bf16, ÷ tp (sequence parallel)
    layer = 9216 * (2 * 2048 + 40 * 128 + 32 * 128 + 2 * 2048 + 8 * (2048 + 3 * 768)) * 2 / 4
    peak = 6 * n + inputs + layer + 9216**2 * 8 * (6 + 8) + moe + 4e9
    assert _row(text, "peak") == round(peak / 1e9, 2) == 60.38
    assert "peak 60.38 GB of 80 GB (fits)" in text
    assert "cannot run" not in text  # tp, optimizer offload and recompute all run
    text141 = _plan(PAPER, "trainer.gpu_memory_gb=141", cwd=tmp_path)
    assert "peak 60.38 GB of 141 GB (fits)" in text141
    # the paper's 32k responses: 181 GB, refused at compose time (`sat plan` and `sat train`)
    out = run_sat("plan", PAPER, "task.max_new_tokens=32768", cwd=tmp_path)
    assert out.returncode == 2 and "estimated peak of 181.5 GB per trainer GPU" in out.stderr
    assert not list(tmp_path.iterdir())  # wrote nothing


# Qwen3-8B by hand (dense: hidden 4096, 36 layers, 32 q / 8 kv heads of 128, FFN 12288, vocab
# 151936, untied)
ATTN_8B = 4096 * (32 + 2 * 8) * 128 + 32 * 128 * 4096  # q, k, v + o = 41,943,040
MLP_8B = 3 * 4096 * 12288  # gate, up, down = 150,994,944
NORMS_8B = 2 * 4096 + 2 * 128  # 2 RMSNorms, q/k norms
EMB_8B = 151936 * 4096
DENSE_8B = "experiment=qwen3_8b_megatron_8gpu"


def test_dense_hand_counts_match_the_table():
    arch = Arch.from_hf(QWEN3_8B)
    assert arch.total() == 36 * (ATTN_8B + MLP_8B + NORMS_8B) + 2 * EMB_8B + 4096 == 8_190_735_360
    lay = Layout(
        1,
        4,
        tp=2,
        pp=1,
        cp=1,
        ep=1,
        etp=1,
        dtype="bfloat16",
        optimizer_offload=False,
        recompute=True,
    )
    # tp 2: attention, MLP, embedding and output layer halved; norms whole; no experts
    assert params_per_gpu(arch, lay) == (
        36 * ((ATTN_8B + MLP_8B) // 2 + NORMS_8B) + EMB_8B + 4096,
        0,
    )
    # Llama has no q/k norms
    llama = Arch.from_hf({**QWEN3_8B, "model_type": "llama"})
    assert arch.total() - llama.total() == 36 * 2 * 128


def test_plan_dense_8gpu_preset_fits_80_gb(tmp_path):
    text = _plan(DENSE_8B, cwd=tmp_path)
    assert "8,190,735,360 (8.19 B) parameters" in text and "dense)" in text
    assert "sglang: 4 server(s) × tp 1 × dp 1 (ep 1) = 4 GPUs" in text
    assert "1 node(s) × 4 processes = 4 ranks" in text and "tp 2, pp 1, cp 1, ep 1" in text
    assert "4 rollout + 4 training, disjoint (engine.colocate=false): node 0 needs 8" in text
    n = 36 * ((ATTN_8B + MLP_8B) // 2 + NORMS_8B) + EMB_8B + 4096  # 4,095,521,792 per GPU
    assert f"{n:,} (dense {n:,}, experts 0)" in text
    assert _row(text, "MoE dispatch") == 0.0
    assert _row(text, "weights") == round(2 * n / 1e9, 2)  # 8.19
    assert _row(text, "gradients") == round(4 * n / 1e9, 2)  # 16.38
    assert _row(text, "optimizer states") == round(12 * n / 2 / 1e9, 2)  # ÷ dp 2: 24.57
    assert "4 × 2048 tokens ÷ tp 2, full recompute" in text  # 1024 prompt + 1024 response
    assert _row(text, "logits") == round(18 * 4 * 2048 * 151936 / 2 / 1e9, 2)  # ÷ tp 2: 11.20
    assert _row(text, "peak") <= 80 and "of 80 GB (fits)" in text and "cannot run" not in text
    assert not list(tmp_path.iterdir())


def test_plan_tiny_megatron_default(tmp_path):
    text = _plan("trainer=megatron", cwd=tmp_path)
    assert "the tiny model (model.*): 1,021,312 parameters" in text
    assert "engines   local: one engine process on the CPU (cpu, float32)" in text
    assert "1 node(s) × 1 processes = 1 ranks" in text
    assert _row(text, "weights") == 0.00409 and _row(text, "overhead") == 4.0  # 4 B × 1,021,312
    assert "cannot run" not in text  # the worker runs this layout
    local = _plan(cwd=tmp_path)
    assert "trainer   local: in the orchestrator process" in local and "megatron" not in local


def test_plan_single_gpu_prints_cuda_and_the_dtypes_used(tmp_path):
    """The one-GPU layouts as they will run: devices and dtypes from the device plan, Qwen3-0.6B's
    architecture known (it was "one engine process on the CPU", "(CPU, float32…)",
    "1 rollout + 0 training" and "architecture unknown")."""
    cuda = ["model=qwen3_0_6b", "engine.device=cuda", "trainer.device=cuda"]
    text = _plan(*cuda, "engine.dtype=float32", cwd=tmp_path)  # the trainer: cuda's bf16
    assert "Qwen/Qwen3-0.6B-Base (sat_cli/models/arch.py): 596,049,920 (0.60 B) parameters" in text
    assert "engines   local: one engine process on the GPU (cuda:0, float32)" in text
    assert (
        "trainer   local: in the orchestrator process on the GPU "
        "(cuda:1, bfloat16 autocast (fp32 weights, AdamW))"
    ) in text
    assert (
        "GPUs      1 rollout + 1 training, disjoint (engine.colocate=false): node 0 needs 2" in text
    )
    text = _plan("engine=sglang", "trainer.device=cuda", "engine.colocate=true", cwd=tmp_path)
    assert "GPUs      1 rollout + 1 training, shared (engine.colocate=true): node 0 needs 1" in text
    assert "CUDA_VISIBLE_DEVICES=0; tp 1 × dp 1, ep 1; 0.4 of each GPU's memory" in text


IMPOSSIBLE = {
    "tp-heads": (
        ["trainer=megatron", "trainer.nproc_per_node=3", "trainer.tp=3"],
        r"trainer\.tp=3 must divide the model's 4 attention heads",
    ),
    "tp-kv-heads": (
        [PAPER, "trainer.nproc_per_node=8", "trainer.tp=8"],
        r"trainer\.tp=8 must divide the model's 4 key/value heads",
    ),
    "ep-experts": (
        ["trainer=megatron", "trainer.nproc_per_node=3", "trainer.ep=3"],
        r"trainer\.ep=3 must divide the model's 8 experts",
    ),
    "world-size": (
        [PAPER, "trainer.nproc_per_node=6"],
        r"trainer\.tp × trainer\.pp × trainer\.cp = 4 × 1 × 1 must divide the number of ranks "
        r"\(trainer\.nproc_per_node × trainer\.nnodes = 6\)",
    ),
    "expert-world-size": (
        [PAPER, "trainer.etp=4", "trainer.nproc_per_node=8"],  # etp 4: 4 × 4 ∤ 8
        r"trainer\.ep=4 must divide .* trainer\.etp × trainer\.ep × trainer\.pp = 4 × 4 × 1",
    ),
    "pp-layers": (
        ["trainer=megatron", "trainer.nproc_per_node=3", "trainer.pp=3"],
        r"trainer\.pp=3 must divide the model's 4 layers",
    ),
    "memory": (
        [PAPER, "trainer.optimizer_offload=false", "trainer.gpu_memory_gb=141"],
        r"estimated peak of 1\d\d\.\d GB per trainer GPU is over trainer\.gpu_memory_gb=141",
    ),
}


@pytest.mark.parametrize("case", sorted(IMPOSSIBLE))
def test_impossible_layout_exits_2_naming_the_key(case, tmp_path):
    args, pattern = IMPOSSIBLE[case]
    out = run_sat("plan", *args, cwd=tmp_path)
    assert out.returncode == 2, out.stdout[-2000:]
    assert "Traceback" not in out.stderr and out.stderr.startswith("sat: error: trainer=megatron")
    assert re.search(pattern, out.stderr), out.stderr


def test_compose_time_runs_the_same_checks():
    """No overlay that composes can fail the layout rules later: `load` refuses them too."""
    with pytest.raises(ConfigError, match=r"trainer\.ep=3 must divide the model's 8 experts"):
        load(["trainer=megatron", "trainer.nproc_per_node=3", "trainer.ep=3"])
    with pytest.raises(ConfigError, match=r"trainer.recompute=true needs trainer=megatron"):
        load(["trainer.recompute=true"])
    _, obj = load([PAPER, "algo=gspo", "lag=8", "r3=true"])  # the paper overlay composes
    assert (obj.trainer.tp, obj.trainer.ep, obj.trainer.etp, obj.trainer.dtype) == (
        4,
        4,
        1,
        "bfloat16",
    )


def test_unimplemented_is_one_constant():
    assert NOT_YET == {"cp", "etp"}
    _, obj = load(["trainer=megatron", "trainer.nproc_per_node=2", "trainer.ep=2"])
    assert unimplemented(Layout.of(obj.trainer)) == []  # data + expert parallel: runs today
    _, obj = load([PAPER])  # TP4/EP4, bf16, optimizer offload, recompute
    assert unimplemented(Layout.of(obj.trainer)) == []
    # tensor and pipeline parallel run (experts whole on each TP rank: etp 1); etp > 1 does not
    _, obj = load(["trainer=megatron", "trainer.nproc_per_node=4", "trainer.tp=2", "trainer.pp=2"])
    assert unimplemented(Layout.of(obj.trainer)) == []
    _, obj = load(["trainer=megatron", "trainer.nproc_per_node=2", "trainer.tp=2", "trainer.etp=2"])
    assert unimplemented(Layout.of(obj.trainer)) == ["trainer.etp=2"]


@pytest.mark.parametrize(
    ("overrides", "nproc"),
    [
        ([], 1),
        (["trainer.tp=2"], 2),
        (["trainer.pp=2"], 2),
        (["trainer.tp=2", "trainer.pp=2"], 4),
        (["trainer.ep=4"], 4),  # experts over 4 ranks: dp 4
        (["trainer.tp=2", "trainer.ep=4"], 4),  # lcm(2, 4)
        (["trainer.pp=2", "trainer.ep=2"], 4),  # ep divides a stage's ranks
        (["trainer.tp=2", "trainer.nproc_per_node=8"], 8),  # given: kept (dp 4)
        (["trainer.nnodes=2"], 1),  # spread over the nodes: 2 ranks in all
        (["trainer.ep=2", "trainer.nnodes=2"], 1),
        (["trainer.tp=2", "trainer.pp=2", "trainer.nnodes=2"], 2),
        (["trainer.tp=2", "trainer.nnodes=3"], 2),  # 6 ranks: the least multiple of 2 and 3
    ],
)
def test_nproc_per_node_defaults_to_the_fewest_ranks_the_layout_needs(overrides, nproc):
    _, obj = load(["trainer=megatron", *overrides])
    assert obj.trainer.nproc_per_node == nproc
    lay = Layout.of(obj.trainer)
    assert lay.world % (lay.tp * lay.pp * lay.cp) == 0 == lay.world % (lay.etp * lay.ep * lay.pp)


def test_trainer_memory_options_are_checked():
    with pytest.raises(ConfigError, match=r"trainer\.recompute=true needs trainer=megatron"):
        load(["trainer.recompute=true"])
    with pytest.raises(ConfigError, match=r"optimizer_offload=true .* needs trainer\.dtype=bf"):
        load(["trainer=megatron", "trainer.optimizer_offload=true"])
    _, obj = load(
        [
            "trainer=megatron",
            "trainer.recompute=true",
            "trainer.dtype=bfloat16",
            "trainer.optimizer_offload=true",
        ]
    )
    assert obj.trainer.recompute and obj.trainer.optimizer_offload


def test_train_refuses_unimplemented_cp_before_anything_starts(tmp_path):
    out = run_sat(
        "train",
        "trainer=megatron",
        "trainer.nproc_per_node=2",
        "trainer.cp=2",
        "run.dir=runs",
        cwd=tmp_path,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert re.search(r"sat: error: trainer=megatron cannot run trainer\.cp=2 yet", out.stderr)
    assert not list(tmp_path.iterdir())  # no run folder, store or cache


def test_train_dry_run_prints_the_plan_and_starts_nothing(tmp_path):
    args = [PAPER, "algo=gspo", "lag=8", "run.dir=runs"]
    out = run_sat("train", *args, "--dry-run", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == _plan(*args, cwd=tmp_path)
    assert "megatron rank, each of 4 (largest pipeline stage) (GPU): peak" in out.stdout
    assert not list(tmp_path.iterdir())  # no run folder, no MLflow store


def test_counts_from_a_local_config_json(tmp_path):
    """model.path with a config.json: the count comes from the file (here the tiny model's,
    written by transformers), and a dense model refuses expert parallelism."""
    from sat_cli.models.tiny_moe import build_config

    moe = tmp_path / "moe"
    build_config().save_pretrained(moe)
    args = ["trainer=megatron", "model.kind=hf", f"model.path={moe}"]
    text = _plan(*args, cwd=tmp_path)
    assert f"{moe / 'config.json'}: 1,021,312 parameters" in text
    dense = tmp_path / "dense"
    dense.mkdir()
    cfg = {k: v for k, v in TINY_MOE_CONFIG.items() if "expert" not in k}
    (dense / "config.json").write_text(json.dumps(cfg))
    out = run_sat(
        "plan",
        "trainer=megatron",
        "model.kind=hf",
        f"model.path={dense}",
        "trainer.nproc_per_node=2",
        "trainer.ep=2",
        cwd=tmp_path,
    )
    assert out.returncode == 2 and "trainer.ep=2 needs a Mixture-of-Experts model" in out.stderr
