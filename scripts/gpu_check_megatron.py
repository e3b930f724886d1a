"""GPU check of the megatron trainer backend (docs/megatron.md): parity with HF and the local
trainer on one GPU, in fp32 and bf16, plus a few training steps and one step through torchrun.

    python scripts/gpu_check_megatron.py                  # on the GPU machine (via the .sh)
    python scripts/gpu_check_megatron.py --device cpu     # CPU smoke of this script (tiny only)

Models: the tiny Qwen3-MoE (STACK.md) and a "medium" one (8 layers, hidden 1024, 64 experts,
top-8, vocab 4096, ~0.4 B parameters), randomly initialised. Checks, each a row of the table:

- ``logits fp32``: max |Δ log-prob| megatron vs HF (TF32 off), free routing;
- ``logits bf16 R3``: mean |Δ log-prob| with HF's own routes replayed through RouterReplay
  (bf16 near-ties flip routing between kernels, so free-routing bf16 is only reported:
  ``route agree bf16`` = fraction of token x layer top-k sets that megatron and HF agree on);
- ``train fp32 R3``: SAT-GRPO + R3, ``--steps`` steps of MegatronActor vs LocalTrainer from the
  same weights and batches: max |Δ loss| over steps and max |Δ weight| at the end;
- ``train bf16``: megatron in bf16, ``--steps`` steps: losses finite, weights moved;
- ``bf16 core``: bf16 with megatron-core's own optimizer (``DistributedDataParallel`` +
  ``get_megatron_optimizer(OptimizerConfig(bf16=True, use_distributed_optimizer=True))``,
  ``sat_cli/trainers/megatron/precision.py``), one SAT-GRPO + R3 step on each model (the medium
  one is the ~0.4 B-parameter MoE step): the core optimizer is in use, the loss is finite, the
  fp32 main weights moved by lr (Adam's first step moves every weight with a non-zero gradient
  by lr: max |Δ main| / lr within 10 % of 1), and the step equals the CPU-tested ``MainWeights``
  path on the same GPU (``SAT_MEGATRON_CORE_OPTIMIZER=0``: same loss, gradient norm, main
  weights within 10 % of lr); save → load → step on the core path equals save → step;
- ``bf16 memory``: the paper overlay's memory options, ``recompute=True`` (megatron's full
  recompute, one layer at a time) and ``optimizer_offload=True`` (megatron-core's
  ``HybridDeviceOptimizer``: fp32 main weights and Adam states on the host), one bf16 SAT-GRPO +
  R3 step on each model against the plain bf16 core step: the hybrid optimizer is in use, same
  loss and gradient norm, main weights within 10 % of lr; the peak GPU memory of both steps is
  reported (offload should remove the 12 B/param of main weights and states from the GPU); on
  the tiny model save -> step equals load -> step on the offload path;
- ``torchrun``: one step through ``MegatronTrainer`` (NCCL, world size 1) equals the in-process
  fp32 step.

Exit status 0 iff every gated row passes. Tolerances are in the table (``tol``); rows with
``-`` are reported, not gated.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sat_cli.engines.base import Sample  # noqa: E402
from sat_cli.models.r3 import RouteCapture  # noqa: E402
from sat_cli.models.tiny_moe import build_char_tokenizer, build_tiny_moe, save_hf  # noqa: E402
from sat_cli.rl.config import LossConfig  # noqa: E402
from sat_cli.trainers.batch import collate  # noqa: E402
from sat_cli.trainers.local import LocalTrainer  # noqa: E402
from sat_cli.trainers.megatron import convert, runtime  # noqa: E402
from sat_cli.trainers.megatron.actor import MegatronActor  # noqa: E402
from sat_cli.trainers.megatron.model import ModelSettings, build_gpt_model  # noqa: E402

MEDIUM = dict(
    vocab_size=4096,
    hidden_size=1024,
    intermediate_size=2048,
    moe_intermediate_size=256,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=64,
    num_experts_per_tok=8,
    max_position_embeddings=2048,
)

ROWS: list[tuple[str, str, str, float, float | None]] = []


def row(check: str, model: str, metric: str, value: float, tol: float | None) -> None:
    ROWS.append((check, model, metric, float(value), tol))
    ok = "" if tol is None else ("PASS" if value <= tol else "FAIL")
    print(f"  {check:<18} {model:<7} {metric:<24} {value:10.3g} {ok}", flush=True)


def make_batch(cfg, n, seed, max_prompt, max_resp, routes=True):
    g = torch.Generator().manual_seed(seed)
    L, E, K = cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok
    samples = []
    for _ in range(n):
        p = int(torch.randint(4, max_prompt + 1, (1,), generator=g))
        r = int(torch.randint(4, max_resp + 1, (1,), generator=g))
        ids = torch.randint(3, cfg.vocab_size, (p + r,), generator=g).tolist()
        rec = torch.rand(p + r - 1, L, E, generator=g).argsort(-1)[..., :K] if routes else None
        samples.append(
            Sample(
                prompt_ids=ids[:p],
                response_ids=ids[p:],
                rollout_logp=(
                    -math.log(cfg.vocab_size) + 0.3 * torch.randn(r, generator=g)
                ).tolist(),
                finish_reason="stop",
                weight_version=0,
                routed_experts=None if rec is None else rec.numpy().astype(np.int32),
            )
        )
    adv = torch.randn(n, generator=g)
    return collate(samples, adv, pad_id=0, need_routes=routes)


def hf_logp(model, ids):
    logits = model(ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def mg_logp(model, ids):
    b, s = ids.shape
    pos = torch.arange(s, device=ids.device).expand(b, s)
    return runtime.token_logprobs(model, ids, pos)[0][:, 1:]


def check_logits(name, ckpt, dev, bf16: bool):
    from transformers import AutoModelForCausalLM

    cfg = convert.read_hf_config(ckpt)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, cfg["vocab_size"], (4, 256), generator=g).to(dev)
    for dtype in [torch.float32] + ([torch.bfloat16] if bf16 else []):
        hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).to(dev).eval()
        mg = build_gpt_model(cfg, ModelSettings(dtype=dtype, routing_replay=True)).to(dev)
        convert.load_hf_into_megatron(mg, ckpt)
        mg.eval()
        with torch.no_grad(), RouteCapture(hf) as cap:
            ref = hf_logp(hf, ids)
        hf_routes = cap.last_call().view(ids.shape[0], ids.shape[1], -1, cfg["num_experts_per_tok"])
        seen: list[torch.Tensor] = []
        hooks = [
            layer.mlp.router.register_forward_hook(lambda m, a, o, seen=seen: seen.append(o[1]))
            for layer in mg.decoder.layers
        ]
        with torch.no_grad():
            free = mg_logp(mg, ids)  # free routing, routing maps recorded by the hooks
        for h in hooks:
            h.remove()
        with torch.no_grad():
            runtime.set_replay_routes(hf_routes, mg.config, device=dev)
            replayed = mg_logp(mg, ids)
            runtime.clear_replay()
        # routing agreement of free routing: megatron routing maps [S*B, E] vs HF sets
        agree = []
        for layer, rmap in enumerate(seen):
            hf_map = torch.zeros_like(rmap)
            r = hf_routes[:, :, layer].transpose(0, 1).reshape(-1, hf_routes.shape[-1]).long()
            hf_map.scatter_(-1, r.to(dev), True)
            agree.append((rmap == hf_map).all(-1).float().mean().item())
        tag = "fp32" if dtype == torch.float32 else "bf16"
        if dtype == torch.float32:
            row("logits fp32", name, "max abs dlogp free", (free - ref).abs().max().item(), 1e-3)
            row(
                "logits fp32 R3",
                name,
                "max abs dlogp replay",
                (replayed - ref).abs().max().item(),
                1e-3,
            )
        else:
            row(
                "logits bf16 R3",
                name,
                "mean abs dlogp replay",
                (replayed - ref).abs().mean().item(),
                2e-2,
            )
            row(
                "logits bf16 R3",
                name,
                "max abs dlogp replay",
                (replayed - ref).abs().max().item(),
                None,
            )
            row("logits bf16", name, "mean abs dlogp free", (free - ref).abs().mean().item(), None)
        row(f"route agree {tag}", name, "1 - frac agree", 1 - float(np.mean(agree)), None)
        del hf, mg
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def check_training(name, ckpt, dev, steps, bf16: bool, big: bool):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(ckpt)
    kw = dict(lr=1e-5, loss=LossConfig(algo="grpo", adaptive=True), num_minibatches=2, r3=True)
    shape = (16, 64, 192) if big else (16, 16, 48)
    batches = [make_batch(cfg, shape[0], 10 + i, shape[1], shape[2]) for i in range(steps)]
    local = LocalTrainer(str(ckpt), device=str(dev), **kw)
    actor = MegatronActor(str(ckpt), **kw)
    dloss, t_loc, t_meg = 0.0, 0.0, 0.0
    for b in batches:
        t0 = time.perf_counter()
        ml = local.step(b)
        t1 = time.perf_counter()
        mm = actor.step(b)
        t2 = time.perf_counter()
        t_loc, t_meg = t_loc + t1 - t0, t_meg + t2 - t1
        dloss = max(dloss, abs(ml["loss/total"] - mm["loss/total"]))
    lw = convert.unfuse_experts(dict(local.model.state_dict()))
    mw = actor.hf_state()
    w0 = convert.load_hf_state(ckpt)
    # lw on the device, w0 read from the file (CPU): compare on the CPU
    dw = max((lw[k].float().cpu() - mw[k].float().cpu()).abs().max().item() for k in lw)
    upd = max((lw[k].float().cpu() - w0[k].float().cpu()).abs().max().item() for k in lw)
    row("train fp32 R3", name, f"max abs dloss {steps} st", dloss, 1e-4)
    row("train fp32 R3", name, "max abs dweight", dw, None)
    # Adam normalises each gradient, so a float-level difference in a near-zero gradient moves
    # a weight by a fraction of lr: gate the difference relative to the largest update.
    row("train fp32 R3", name, "dweight / max update", dw / max(upd, 1e-30), 0.1)
    row("train fp32 R3", name, "s/step local", t_loc / steps, None)
    row("train fp32 R3", name, "s/step megatron", t_meg / steps, None)
    del local, actor
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    if bf16:
        actor = MegatronActor(str(ckpt), dtype="bfloat16", **kw)
        before = {k: v.clone() for k, v in actor.hf_state().items()}
        losses = [actor.step(b)["loss/total"] for b in batches]
        after = actor.hf_state()
        moved = _max_diff(after, before)
        row("train bf16", name, "non-finite losses", sum(not math.isfinite(x) for x in losses), 0)
        row("train bf16", name, "weights moved (1=yes)", float(moved > 0), None)
        del actor
    return batches[0]


def _main_weights(actor) -> dict[str, torch.Tensor]:
    """A copy of the fp32 main weights by parameter name, flattened (either bf16 path)."""
    if actor.core is not None:
        t = actor.core.state_tensors(actor.model.named_parameters())
        return {
            k.split("/")[1]: v.reshape(-1).clone() for k, v in t.items() if k.endswith("/param")
        }
    return {n: m.detach().reshape(-1).cpu().clone() for n, m in actor.main.named()}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float().cpu() - b[k].float().cpu()).abs().max().item() for k in a)


def check_bf16(name, ckpt, dev, batch, work):
    # one actor at a time: under R3 the newest actor's routers are the replay-registered ones
    lr = 1e-5
    kw = dict(lr=lr, loss=LossConfig(algo="grpo", adaptive=True), r3=True)
    on_gpu = dev.type == "cuda"
    t0 = time.perf_counter()
    core = MegatronActor(str(ckpt), dtype="bfloat16", **kw)
    row(
        "bf16 core", name, "core optimizer missing", float(core.core is None), 0 if on_gpu else None
    )
    before = _main_weights(core)
    m = core.step(batch)
    after = _main_weights(core)
    row("bf16 core", name, "non-finite loss", float(not math.isfinite(m["loss/total"])), 0)
    row("bf16 core", name, "abs(max dmain / lr - 1)", abs(_max_diff(after, before) / lr - 1), 0.1)
    row("bf16 core", name, "s/step (incl. build)", time.perf_counter() - t0, None)
    if name == "tiny":  # checkpoint on this path: save -> step equals load -> step
        core.save(Path(work) / f"ckpt_{name}")
        core.step(batch)
        expect, expect_w = _main_weights(core), core.hf_state()
        core = None  # freed before the second actor is built
        if on_gpu:
            torch.cuda.empty_cache()
        again = MegatronActor(str(ckpt), dtype="bfloat16", **kw)
        again.load(Path(work) / f"ckpt_{name}")
        again.step(batch)
        row("bf16 core", name, "resume: max dmain", _max_diff(_main_weights(again), expect), 0)
        row("bf16 core", name, "resume: max dweight", _max_diff(again.hf_state(), expect_w), 0)
        del again
    del core
    if on_gpu:
        torch.cuda.empty_cache()
    # the CPU-tested path on the same device, from the same weights and batch
    os.environ["SAT_MEGATRON_CORE_OPTIMIZER"] = "0"
    try:
        ref = MegatronActor(str(ckpt), dtype="bfloat16", **kw)
    finally:
        del os.environ["SAT_MEGATRON_CORE_OPTIMIZER"]
    mr = ref.step(batch)
    row(
        "bf16 core", name, "abs dloss vs MainWeights", abs(m["loss/total"] - mr["loss/total"]), 1e-5
    )
    rel = abs(m["loss/grad_norm"] / mr["loss/grad_norm"] - 1)
    row("bf16 core", name, "rel dgradnorm vs Main", rel, 1e-4)
    row(
        "bf16 core",
        name,
        "dmain / lr vs MainWeights",
        _max_diff(after, _main_weights(ref)) / lr,
        0.1,
    )
    del ref
    if on_gpu:
        torch.cuda.empty_cache()


def _peak_gib(dev) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")


def check_memory_options(name, ckpt, dev, batch):
    """bf16 with recompute + optimizer offload against plain bf16 (module docstring)."""
    lr = 1e-5
    kw = dict(lr=lr, loss=LossConfig(algo="grpo", adaptive=True), r3=True, dtype="bfloat16")
    on_gpu = dev.type == "cuda"
    results = {}
    for tag, extra in (("plain", {}), ("memory", dict(recompute=True, optimizer_offload=True))):
        if on_gpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        actor = MegatronActor(str(ckpt), **kw, **extra)
        if tag == "memory" and on_gpu:
            subs = actor.core.subs if actor.core is not None else []
            hybrid = [type(getattr(s, "optimizer", None)).__name__ for s in subs]
            row(
                "bf16 memory",
                name,
                "hybrid optimizer missing",
                float("HybridDeviceOptimizer" not in hybrid),
                0,
            )
        before = _main_weights(actor)
        t0 = time.perf_counter()
        m = actor.step(batch)
        results[tag] = (m, _main_weights(actor), before)
        row("bf16 memory", name, f"s/step {tag}", time.perf_counter() - t0, None)
        row("bf16 memory", name, f"peak GPU GiB {tag}", _peak_gib(dev), None)
        del actor
        if tag == "memory" and name == "tiny":  # resume on the offload path (check_bf16's)
            guarded("bf16 memory", name, _offload_resume, ckpt, kw, extra, batch)
    (m0, w0, _), (m1, w1, b1) = results["plain"], results["memory"]
    row("bf16 memory", name, "abs dloss vs plain", abs(m1["loss/total"] - m0["loss/total"]), 1e-5)
    rel = abs(m1["loss/grad_norm"] / m0["loss/grad_norm"] - 1)
    row("bf16 memory", name, "rel dgradnorm vs plain", rel, 1e-4)
    row("bf16 memory", name, "abs(max dmain / lr - 1)", abs(_max_diff(w1, b1) / lr - 1), 0.1)
    row("bf16 memory", name, "dmain / lr vs plain", _max_diff(w1, w0) / lr, 0.1)
    if on_gpu:
        torch.cuda.empty_cache()


def _offload_resume(ckpt, kw, extra, batch):
    """save -> step equals load -> step with recompute + optimizer offload."""
    work = Path(tempfile.mkdtemp(prefix="offload_resume_"))
    actor = MegatronActor(str(ckpt), **kw, **extra)
    actor.step(batch)
    actor.save(work / "ckpt")
    actor.step(batch)
    expect, expect_w = _main_weights(actor), actor.hf_state()
    del actor
    again = MegatronActor(str(ckpt), **kw, **extra)
    again.load(work / "ckpt")
    again.step(batch)
    row("bf16 memory", "tiny", "resume: max dmain", _max_diff(_main_weights(again), expect), 0)
    row("bf16 memory", "tiny", "resume: max dweight", _max_diff(again.hf_state(), expect_w), 0)


def check_torchrun(ckpt, batch, work):
    from sat_cli.trainers.megatron.client import MegatronTrainer
    from sat_cli.trainers.megatron.settings import MegatronRuntime, MegatronTrainerSettings

    loss = LossConfig(algo="grpo", adaptive=True)
    actor = MegatronActor(str(ckpt), lr=1e-5, loss=loss, num_minibatches=2, r3=True)
    expect = actor.step(batch)["loss/total"]
    del actor
    t0 = time.perf_counter()
    options = {"num_minibatches": 2, "r3": True}
    runtime = MegatronRuntime(str(ckpt), work, loss=loss, options=options)
    with MegatronTrainer(MegatronTrainerSettings(lr=1e-5), runtime) as trainer:
        startup = time.perf_counter() - t0
        got = trainer.step(batch)["loss/total"]
        pub = trainer.publish_weights(Path(work) / "weights", 1)
    row("torchrun", "tiny", "abs dloss vs in-proc", abs(got - expect), 1e-5)
    row("torchrun", "tiny", "startup s", startup, None)
    row("torchrun", "tiny", "published files", len(list(Path(pub).iterdir())), None)


def guarded(check: str, name: str, fn, *args) -> None:
    """Run one check; an exception becomes a failed row (traceback printed) and the later
    checks still run, so one call of the script reports everything it can."""
    import traceback

    try:
        fn(*args)
    except Exception:
        traceback.print_exc()
        row(check, name, "raised (see traceback)", 1.0, 0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--models", default="tiny,medium", help="comma list of tiny, medium")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu for a smoke of this script", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    on_gpu = dev.type == "cuda"
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check_megatron_") as tmp:
        runtime.init_distributed(file_store=Path(tmp) / "store")
        print(f"torch {torch.__version__}, device {dev}", flush=True)
        print(f"  {'check':<18} {'model':<7} {'metric':<24} {'value':>10}", flush=True)
        first_batch = None
        for name in args.models.split(","):
            overrides = MEDIUM if name == "medium" else {}
            if name == "medium" and not on_gpu:
                print("  (medium skipped on CPU)")
                continue
            ckpt = Path(tmp) / name
            tok = build_char_tokenizer() if name == "tiny" else None
            save_hf(build_tiny_moe(seed=0, **overrides), tok, ckpt)
            check_logits(name, ckpt, dev, bf16=on_gpu)
            batch = check_training(name, ckpt, dev, args.steps, bf16=on_gpu, big=name == "medium")
            guarded("bf16 core", name, check_bf16, name, ckpt, dev, batch, Path(tmp) / "bf16")
            guarded("bf16 memory", name, check_memory_options, name, ckpt, dev, batch)
            if name == "tiny":
                first_batch = batch
        if first_batch is not None:
            check_torchrun(Path(tmp) / "tiny", first_batch, Path(tmp) / "torchrun")
    failed = [r for r in ROWS if r[4] is not None and not r[3] <= r[4]]
    print("\n| check | model | metric | value | tol | ok |")
    print("|---|---|---|---|---|---|")
    for check, model, metric, value, tol in ROWS:
        ok = "-" if tol is None else ("PASS" if value <= tol else "FAIL")
        print(
            f"| {check} | {model} | {metric} | {value:.3g} | {'-' if tol is None else tol} | {ok} |"
        )
    print(f"\n{len(ROWS)} rows, {len(failed)} failed, {time.perf_counter() - t_start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
