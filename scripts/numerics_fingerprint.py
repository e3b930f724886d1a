"""Numerics fingerprint: which op class gives other bits on this CPU kind (issue 58, item 1).

Runs each op class the default ``sat train`` uses — fp32 and bf16 matmuls at the run's shapes
(forward and backward), attention (SDPA), softmax / log-softmax, exp / log, elementwise
activations, RMSNorm and norms, reductions, MoE routing, random numbers, sampling, the AdamW
step — on seeded inputs, under the pins of ``run.portable_numerics=true`` (``sat_cli.numerics``:
the same variables, set before torch loads, one thread as the default trainer), and hashes each
result bit for bit (sha256 of the raw bytes). Inputs are integers from torch's seeded
generator scaled by powers of two, so they are exact on every CPU; only the op under test can
make bits differ. Each class runs twice in the process: ``repeatable`` says whether the two
agree (a CPU-kind comparison means nothing without it).

Needs torch and the standard library only (the two torch-free ``sat_cli`` modules it imports
pull in nothing else; ``imports_before_torch`` in the output lists what was loaded before
torch). Usage, from the repository root:

    python scripts/numerics_fingerprint.py                     # -> numerics_fingerprint.json
    python scripts/numerics_fingerprint.py --compare tests/data/numerics_fingerprint.json
    python scripts/numerics_fingerprint.py --mode default      # torch's own CPU paths, no pins
    python scripts/numerics_fingerprint.py --record tests/data/numerics_fingerprint.json

``--compare FILE`` finds in FILE the recorded entry of this CPU kind, torch version and mode
(or, for a kind not recorded, the nearest entry: same torch version and mode first, then the
same vendor, model and most ISA flags in common) and says per op class ``equal`` or
``differs``; the result is also in the output JSON under ``comparison``. ``--record FILE``
adds this run's entry to FILE (replacing one of the same kind, torch version and mode).
In portable mode a class the nearest entry lacks (added or redefined after that kind was
recorded) is compared with the value the other recorded kinds agree on, and the output names
them: the portable mode's claim is that the kind does not matter.
Exit status: 0, or 1 when ``--compare`` found the same kind recorded and some class differs,
or 2 when the portable pins cannot be applied on this machine.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

_AT_START = set(sys.modules)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

from sat_cli.numerics import ISA_FLAGS, PortableError, cpu_info, numeric_env, pin  # noqa: E402
from sat_cli.tracking.environment import mkl_branches, parse_library_versions  # noqa: E402

SEED = 20261204
# the default run's shapes (sat_cli/models/arch.py TINY_MOE_CONFIG; 32 prompts x 8 samples of
# "123+456=" plus up to 16 tokens; the local engine samples 256 rows per forward)
ROWS, SEQ, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 256, 24, 128, 4, 2, 32
VOCAB, EXPERTS, TOP_K, EXPERT_DIM = 128, 8, 2, 64
TOKENS = ROWS * SEQ
EXPERT_TOKENS = TOKENS * TOP_K // EXPERTS


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=("portable", "default"), default="portable")
    p.add_argument("--threads", type=int, default=1, choices=range(1, 257), metavar="1..256")
    p.add_argument("--out", default="numerics_fingerprint.json", help="JSON output ('-': none)")
    p.add_argument("--compare", metavar="FILE", help="recorded fingerprints to compare with")
    p.add_argument("--record", metavar="FILE", help="add this run's entry to FILE")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- op classes


def _classes(torch, mode: str = "portable"):
    F = torch.nn.functional

    def exact(gen, *shape, scale=1.0, dtype=torch.float32):
        """Dyadic values in [-scale, scale): exact in fp32 on every CPU."""
        ints = torch.randint(-(2**20), 2**20, shape, generator=gen, dtype=torch.int64)
        return (ints.to(torch.float64) * (scale / 2**20)).to(dtype)

    def linears(gen, dtype):
        shapes = {  # name: (tokens, in, out)
            "q_proj": (TOKENS, HIDDEN, HEADS * HEAD_DIM),
            "kv_proj": (TOKENS, HIDDEN, KV_HEADS * HEAD_DIM),
            "router": (TOKENS, HIDDEN, EXPERTS),
            "lm_head": (TOKENS, HIDDEN, VOCAB),
            "o_proj_decode": (ROWS, HEADS * HEAD_DIM, HIDDEN),
            "expert_up": (EXPERT_TOKENS, HIDDEN, EXPERT_DIM),
            "expert_down": (EXPERT_TOKENS, EXPERT_DIM, HIDDEN),
        }
        out = {}
        for name, (t, k, n) in shapes.items():
            x, w = exact(gen, t, k, dtype=dtype), exact(gen, n, k, scale=0.125, dtype=dtype)
            out[name] = F.linear(x, w)
        return out

    def matmul_fp32_backward(gen):
        out = {}
        shapes = {
            "q_proj": (TOKENS, HIDDEN, HIDDEN),
            "expert_down": (EXPERT_TOKENS, EXPERT_DIM, HIDDEN),
        }
        for name, (t, k, n) in shapes.items():
            x, w = exact(gen, t, k).requires_grad_(), exact(gen, n, k, scale=0.125)
            w.requires_grad_()
            F.linear(x, w).backward(exact(gen, t, n))
            out[f"{name}_dx"], out[f"{name}_dw"] = x.grad, w.grad
        return out

    def sdpa(gen, dtype, backward=False):
        q = exact(gen, ROWS, HEADS, SEQ, HEAD_DIM, dtype=dtype)
        k = exact(gen, ROWS, KV_HEADS, SEQ, HEAD_DIM, dtype=dtype)
        v = exact(gen, ROWS, KV_HEADS, SEQ, HEAD_DIM, dtype=dtype)
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
        pad = torch.randint(0, 8, (ROWS,), generator=gen)  # left padding per row
        keep = torch.arange(SEQ)[None, :] >= pad[:, None]  # [B, S]
        mask = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()[None] & keep[:, None, :]
        mask = mask | torch.eye(SEQ, dtype=torch.bool)[None]  # padded rows see themselves
        if backward:
            q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = {
            "prefill_mask": F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None]),
            "prefill_causal": F.scaled_dot_product_attention(q, k, v, is_causal=True),
        }
        if backward:
            out["prefill_mask"].backward(exact(gen, *out["prefill_mask"].shape))
            return {"dq": q.grad, "dk": k.grad, "dv": v.grad}
        out["decode"] = F.scaled_dot_product_attention(
            q[:, :, -1:], k, v, attn_mask=keep[:, None, None]
        )
        return out

    def softmax(gen):
        z = exact(gen, TOKENS, VOCAB, scale=16.0)
        r = exact(gen, TOKENS, EXPERTS, scale=4.0)
        z_grad = z.clone().requires_grad_()
        F.log_softmax(z_grad, dim=-1).backward(exact(gen, TOKENS, VOCAB))
        return {
            "softmax_vocab": torch.softmax(z, -1),
            "log_softmax_vocab": torch.log_softmax(z, -1),
            "log_softmax_grad": z_grad.grad,
            "softmax_router": torch.softmax(r, -1),
            "logsumexp": torch.logsumexp(z, -1),
        }

    def exp_log(gen):
        x = exact(gen, TOKENS, 64, scale=32.0)
        pos = exact(gen, TOKENS, 64, scale=64.0).abs() + 2.0**-20
        return {
            "exp": x.exp(),
            "log": pos.log(),
            "log1p": pos.log1p(),
            "expm1": (x / 8).expm1(),
            "exp_ratio": (x / 16 - x.flip(-1) / 16).exp(),
        }

    def elementwise(gen):
        x = exact(gen, EXPERT_TOKENS, EXPERT_DIM, scale=8.0).requires_grad_()
        y = F.silu(x)
        y.backward(exact(gen, EXPERT_TOKENS, EXPERT_DIM))
        ang = torch.arange(SEQ, dtype=torch.float32)[:, None] * (
            1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
        )
        pos = exact(gen, TOKENS, HIDDEN, scale=8.0).abs() + 2.0**-10
        return {
            "silu": y.detach(),
            "silu_grad": x.grad,
            "sigmoid": torch.sigmoid(x.detach()),
            "rope_cos": ang.cos(),
            "rope_sin": ang.sin(),
            "rsqrt": pos.rsqrt(),
            "pow": pos.pow(-0.5),
            "tanh": x.detach().tanh(),
        }

    def norms(gen):
        x = exact(gen, TOKENS, HIDDEN, scale=4.0).requires_grad_()
        w = 1.0 + exact(gen, HIDDEN, scale=0.25)
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        y.backward(exact(gen, TOKENS, HIDDEN))
        grads = [
            exact(gen, *s) for s in [(HIDDEN, HIDDEN), (EXPERTS, EXPERT_DIM, HIDDEN), (VOCAB,)]
        ]
        return {
            "rmsnorm": y.detach(),
            "rmsnorm_grad": x.grad,
            "vector_norm": torch.linalg.vector_norm(x.detach(), 2.0, dim=-1),
            "grad_norm_total": torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g, 2.0) for g in grads]), 2.0
            ),
        }

    def reductions(gen):
        x = exact(gen, ROWS, SEQ * 40, scale=4.0)
        return {
            "sum_all": x.sum(),
            "sum_rows": x.sum(-1),
            "sum_cols": x.sum(0),
            "mean": x.mean(-1),
            "std": x.std(-1),
            "cumsum": x.cumsum(-1),
            "quantile": torch.quantile(x[:8].abs().flatten(), 0.9),
            "max_min": torch.stack([x.amax(-1), x.amin(-1)]),
        }

    def moe_routing(gen):
        h = exact(gen, TOKENS, HIDDEN)
        probs = torch.softmax(F.linear(h, exact(gen, EXPERTS, HIDDEN, scale=0.125)), -1)
        weights, chosen = torch.topk(probs, TOP_K, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros(TOKENS, HIDDEN)
        for e in range(EXPERTS):
            tok, slot = torch.where(chosen == e)
            y = F.linear(h[tok], exact(gen, HIDDEN, HIDDEN, scale=0.125)) * weights[tok, slot, None]
            out.index_add_(0, tok, y)
        return {"weights": weights, "chosen": chosen, "combined": out}

    def rng(gen):
        return {
            "rand": torch.rand(ROWS, VOCAB, generator=gen),
            "randn": torch.randn(ROWS, VOCAB, generator=gen),
            "normal_": torch.empty(HIDDEN, HIDDEN).normal_(0.0, 0.02, generator=gen),
        }

    def sampling(gen):
        logp = torch.log_softmax(exact(gen, ROWS, VOCAB, scale=8.0), -1)
        sorted_z, order = torch.sort(logp, dim=-1, descending=True, stable=True)
        return {
            "multinomial": torch.multinomial(logp.exp(), 1, generator=gen),
            "multinomial_again": torch.multinomial(logp.exp(), 1, generator=gen),
            "sort": torch.stack([sorted_z, order.float()]),
            "topk": torch.topk(logp, 20, dim=-1).values,
            "top_p_cumsum": torch.softmax(sorted_z, -1).cumsum(-1),
        }

    def adamw(gen):
        shapes = [(VOCAB, HIDDEN), (HIDDEN, HIDDEN), (EXPERTS * EXPERT_DIM, HIDDEN), (HIDDEN,)]
        params = [torch.nn.Parameter(exact(gen, *s, scale=0.125)) for s in shapes]
        # as the trainer builds it (trainers/step.py): the fused CPU kernel in portable mode
        fused = True if mode == "portable" else None
        opt = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.98), weight_decay=0.0, fused=fused)
        for _ in range(3):
            for p in params:
                p.grad = exact(gen, *p.shape, scale=2.0)
            total = torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
        out = {f"param_{i}": p.detach() for i, p in enumerate(params)}
        out["clip_total_norm"] = total
        out["exp_avg_sq_0"] = opt.state[params[0]]["exp_avg_sq"]
        return out

    return {
        "matmul_fp32": lambda g: linears(g, torch.float32),
        "matmul_fp32_backward": matmul_fp32_backward,
        "matmul_bf16": lambda g: linears(g, torch.bfloat16),
        "sdpa_fp32": lambda g: sdpa(g, torch.float32),
        "sdpa_fp32_backward": lambda g: sdpa(g, torch.float32, backward=True),
        "sdpa_bf16": lambda g: sdpa(g, torch.bfloat16),
        "softmax_log_softmax": softmax,
        "exp_log": exp_log,
        "elementwise": elementwise,
        "norms": norms,
        "reductions": reductions,
        "moe_routing": moe_routing,
        "rng": rng,
        "sampling": sampling,
        "adamw": adamw,
    }


def _digest(t) -> str:
    """sha256 of the tensor's raw bytes (a contiguous copy; ctypes: no numpy needed)."""
    t = t.detach().contiguous().clone()
    raw = ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())
    return hashlib.sha256(raw).hexdigest()[:16]


def fingerprint(torch, mode: str = "portable") -> dict:
    """``{class: {"hash", "repeatable", "parts": {part: hash}}}``: each class run twice from
    the same seed."""
    result = {}
    for i, (name, fn) in enumerate(_classes(torch, mode).items()):
        runs = []
        for _ in range(2):
            gen = torch.Generator().manual_seed(SEED + i)
            runs.append({part: _digest(t) for part, t in sorted(fn(gen).items())})
        joined = "".join(f"{k}={v};" for k, v in runs[0].items())
        result[name] = {
            "hash": hashlib.sha256(joined.encode()).hexdigest()[:16],
            "repeatable": runs[0] == runs[1],
            "parts": runs[0],
        }
    return result


# ----------------------------------------------------------------------------- the CPU kind


def machine(torch) -> dict:
    cpu = cpu_info()
    try:
        libs = parse_library_versions(torch.__config__.show())
    except (RuntimeError, AttributeError):
        libs = {"mkl": "unknown", "onednn": "unknown"}
    mkl = mkl_branches()
    return {
        "cpu_model": cpu["model"],
        "cpu_vendor": cpu["vendor"],
        "isa_flags": " ".join(f for f in ISA_FLAGS if f in cpu["flags"]) or "none",
        "arch": platform.machine(),
        "torch": str(torch.__version__).split("+")[0],
        "torch_build": str(torch.__version__),
        "python": platform.python_version(),
        "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        "num_threads": torch.get_num_threads(),
        "mkl": libs["mkl"],
        "onednn": libs["onednn"],
        "mkl_cbwr": mkl["cbwr"],
        "mkl_auto_branch": mkl["auto_branch"],
        "numeric_env": numeric_env(),
    }


KIND_KEYS = ("cpu_vendor", "cpu_model", "isa_flags", "torch")


def _nearness(entry: dict, this: dict) -> tuple:
    m, mine = entry["machine"], this["machine"]
    flags, my_flags = set(m["isa_flags"].split()), set(mine["isa_flags"].split())
    return (
        entry["mode"] == this["mode"],
        m["torch"] == mine["torch"],
        m["cpu_vendor"] == mine["cpu_vendor"],
        m["cpu_model"] == mine["cpu_model"],
        len(flags & my_flags) - len(flags ^ my_flags),
    )


def compare(this: dict, recorded: list[dict]) -> dict:
    """This run against the recorded entry of the same kind (``matched``) or, for a kind not
    recorded, the nearest one: ``{"matched", "against": machine, "classes": {name: equal |
    differs | missing}, "parts_differing": {name: [part]}}``."""
    if not recorded:
        return {"matched": False, "against": None, "classes": {}, "parts_differing": {}}
    best = max(recorded, key=lambda e: _nearness(e, this))
    same = this["mode"] == best["mode"] and all(
        best["machine"][k] == this["machine"][k] for k in KIND_KEYS
    )
    classes, parts, borrowed = {}, {}, {}
    for name, got in this["ops"].items():
        ref = best["ops"].get(name)
        if ref is None and this["mode"] == "portable":
            ref, borrowed[name] = _consensus(name, this, recorded)
        classes[name] = (
            "missing" if ref is None else "equal" if ref["hash"] == got["hash"] else "differs"
        )
        if classes[name] == "differs":
            parts[name] = [p for p, h in got["parts"].items() if ref["parts"].get(p) != h]
    return {
        "matched": same,
        "against": best["machine"],
        "against_mode": best["mode"],
        "classes": classes,
        "parts_differing": parts,
        "borrowed": {k: v for k, v in borrowed.items() if v},
    }


def _consensus(name: str, this: dict, recorded: list[dict]) -> tuple[dict | None, list[str]]:
    """A class the nearest entry lacks (added or redefined after that kind was recorded): in
    portable mode, the value every other recorded kind of this torch version gives, if they
    agree (the mode's claim is that the kind does not matter); ``(op, [cpu models])``."""
    same = [
        e
        for e in recorded
        if e["mode"] == "portable"
        and e["machine"]["torch"] == this["machine"]["torch"]
        and name in e["ops"]
    ]
    if not same or len({e["ops"][name]["hash"] for e in same}) != 1:
        return None, []
    return same[0]["ops"][name], [e["machine"]["cpu_model"] for e in same]


def _write_json(path: str, data) -> None:
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent or ".", prefix=".", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, target)


def _load_entries(path: str) -> list[dict]:
    try:
        return json.loads(Path(path).read_text())["entries"]
    except FileNotFoundError:
        return []


def main(argv=None) -> int:
    args = _parse(argv)
    if args.out != "-":  # checked before the work (sat_cli.util.script_args)
        from sat_cli.util.script_args import output_file

        args.out = str(output_file("scripts/numerics_fingerprint.py", args.out, "--out"))
    before = sorted(  # what the sat_cli imports above loaded besides the standard library
        m for m in set(sys.modules) - _AT_START if m.split(".")[0] not in sys.stdlib_module_names
    )
    if args.mode == "portable":
        try:
            pin(args.threads)
        except PortableError as exc:
            print(f"numerics_fingerprint: {exc}", file=sys.stderr)
            return 2
    import torch

    torch.set_num_threads(args.threads)  # as the run sets trainer.num_threads
    this = {"mode": args.mode, "machine": machine(torch), "ops": fingerprint(torch, args.mode)}
    this["imports_before_torch"] = before
    status = 0
    m = this["machine"]
    print(f"{m['cpu_vendor']} | {m['cpu_model']} | {m['isa_flags']}")
    print(
        f"torch {m['torch_build']} ({m['cpu_capability']}), MKL {m['mkl']} "
        f"(cbwr {m['mkl_cbwr']}, auto {m['mkl_auto_branch']}), oneDNN {m['onednn']}, "
        f"mode {args.mode}: {m['numeric_env']}"
    )
    if args.compare:
        this["comparison"] = cmp = compare(this, _load_entries(args.compare))
        if cmp["against"] is None:
            print(f"no recorded entries in {args.compare}")
        else:
            a = cmp["against"]
            how = "this kind" if cmp["matched"] else "not recorded; nearest"
            print(
                f"compared with {how}: {a['cpu_vendor']} | {a['cpu_model']} | torch {a['torch']}"
                f" | {cmp['against_mode']}"
            )
            status = 1 if cmp["matched"] and set(cmp["classes"].values()) != {"equal"} else 0
    for name, op in this["ops"].items():
        verdict = this.get("comparison", {}).get("classes", {}).get(name, "")
        lent = this.get("comparison", {}).get("borrowed", {}).get(name)
        verdict += f" (recorded on {', '.join(lent)})" if lent else ""
        flag = "" if op["repeatable"] else "  NOT REPEATABLE"
        extra = ", ".join(this.get("comparison", {}).get("parts_differing", {}).get(name, []))
        print(f"  {name:22s} {op['hash']}  {verdict}{flag}{'  (' + extra + ')' if extra else ''}")
    if args.out != "-":
        _write_json(args.out, this)
        print(f"written: {args.out}")
    if args.record:
        entries = [
            e
            for e in _load_entries(args.record)
            if not (e["mode"] == this["mode"] and all(e["machine"][k] == m[k] for k in KIND_KEYS))
        ]
        entry = {k: this[k] for k in ("mode", "machine", "ops")}
        _write_json(args.record, {"entries": [*entries, entry]})
        print(f"recorded in {args.record} ({len(entries) + 1} entries)")
    return status


if __name__ == "__main__":
    sys.exit(main())
