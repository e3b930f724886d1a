"""Bad input is refused cleanly, and the security rules hold (issue 10).

Bad-input catalogue: every case runs the real `sat` command line in its own process
(``python -m sat_cli.cli``, cwd = a fresh temporary folder) and must end with the documented exit
code (2 for the user's input) and a ``sat: error:`` message that names the problem — never a
traceback — and must leave the temporary folder's tree exactly as it was: the same files with
the same sizes and modification times (nothing written anywhere, not even a run directory; in the
cases over a real finished run, not its config, checkpoints or MLflow store, whose run stays
FINISHED). Files offered as weights that are pickles carry a payload that would create a marker
folder if they were ever unpickled; the marker must not appear.

Security: servers bind 127.0.0.1 by default, weights are never unpickled (no ``torch.load``
without ``weights_only=True``, no ``pickle.load``), no ``shell=True`` / ``os.system``, and
secrets in the config never reach MLflow params.
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import seeded_store
from typer.testing import CliRunner

from sat_cli.cli import app

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "sat_cli" / "assets" / "tiny_moe_warm"
MARKER = "UNPICKLED_MARKER"


class _Payload:
    """A pickle that creates a folder when loaded (what a hostile checkpoint would do)."""

    def __init__(self, target: str):
        self.target = target

    def __reduce__(self):
        return (os.mkdir, (self.target,))


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with (size, mtime) for files: a rewrite with the same content
    still shows."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns) if p.is_file() else (-1, 0)
    return out


def _copy_model(dst: Path) -> Path:
    shutil.copytree(TINY, dst)
    return dst


def _pickle_only(dst: Path, marker: Path) -> Path:
    """An HF folder whose weights are only a pickle (``pytorch_model.bin``)."""
    dst.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, dst / name)
    (dst / "pytorch_model.bin").write_bytes(pickle.dumps(_Payload(str(marker))))
    return dst


def _wrong_shapes(dst: Path) -> Path:
    """The tiny model with its embedding cut to half width (128 x 64 instead of 128 x 128)."""
    from safetensors.torch import load_file, save_file

    _copy_model(dst)
    sd = load_file(str(dst / "model.safetensors"))
    sd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"][:, :64].contiguous()
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _pickle_as_safetensors(dst: Path, marker: Path) -> Path:
    """A pickle renamed ``model.safetensors`` (the header does not parse)."""
    _copy_model(dst)
    (dst / "model.safetensors").write_bytes(pickle.dumps(_Payload(str(marker))))
    return dst


def _ckpt(root: Path, model_dir_builder) -> Path:
    """A training-checkpoint layout ``step_3/trainer/model`` with the given model folder."""
    ck = root / "run" / "checkpoints" / "step_3"
    (ck / "trainer").mkdir(parents=True)
    model_dir_builder(ck / "trainer" / "model")
    (ck / "loop_state.json").write_text('{"step": 3}')
    return ck


def _jsonl(root: Path, name: str, data: bytes) -> Path:
    p = root / "data" / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return p


GOOD_ROW = b'{"id": "a", "problem": "1+1?", "answer": "2"}\n'


def _resume_corrupt(root: Path) -> list[str]:
    ck = root / "runs" / "sat" / "r" / "checkpoints" / "step_2"
    (ck / "trainer").mkdir(parents=True)
    (ck / "loop_state.json").write_text("{not json")
    return ["train", "experiment=cpu_smoke", "run.dir=runs", "run.name=r", "resume=auto"]


SWEEP = "name: {name}\nbase: [experiment=cpu_smoke]\naxes: {{}}\nmethods:\n  A: [{method}]\nseeds: [0]\n"


# ---- weights that are not the model their config describes (issue 16)


def _edit_weights(dst: Path, edit) -> Path:
    from safetensors.torch import load_file, save_file

    _copy_model(dst)
    sd = load_file(str(dst / "model.safetensors"))
    edit(sd)
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _drop_head_and_layer(sd: dict) -> None:
    """lm_head and the whole last layer removed (transformers would initialise them at random)."""
    del sd["lm_head.weight"]
    for k in [k for k in sd if k.startswith("model.layers.3.")]:
        del sd[k]


def _drop_one_expert(sd: dict) -> None:
    del sd["model.layers.0.mlp.experts.5.up_proj.weight"]


def _add_tensor(sd: dict) -> None:
    import torch

    sd["model.layers.0.mlp.shared_expert.weight"] = torch.zeros(4, 4)


def _int_tensor(sd: dict) -> None:
    import torch

    sd["model.norm.weight"] = sd["model.norm.weight"].to(torch.int32)


def _missing_shard(dst: Path) -> Path:
    _copy_model(dst)
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def _tokenizer_damage(dst: Path, how: str) -> Path:
    _copy_model(dst)
    if how == "missing":
        (dst / "tokenizer.json").unlink()
        (dst / "tokenizer_config.json").unlink()
    else:
        (dst / "tokenizer.json").write_bytes((dst / "tokenizer.json").read_bytes()[:100])
    return dst


def _file(t: Path, name: str) -> str:
    (t / name).write_text("not a folder\n")
    return name


def _held_lock(run_dir: Path) -> None:
    """The run folder owned by a live process: this test process takes its lock."""
    from sat_cli.commands.runlock import RunLock

    _HELD.append(RunLock(run_dir, log=lambda m: None).acquire())


_HELD: list = []

# ---- a real finished run (built once per module by `finished_run`) and damage done to it
RUN_ARGS = [
    "experiment=cpu_smoke",
    "task.prompts_per_step=2",
    "task.samples_per_prompt=2",
    "eval.every=0",
    "checkpoint.every=1",
    "max_steps=2",
    "run.dir=runs",
    "run.name=done",
]
_FINISHED: list[Path] = []


def _with_run(t: Path) -> Path:
    shutil.copytree(_FINISHED[0], t / "runs", symlinks=True)
    return t / "runs" / "sat" / "done"


def _flip_byte(p: Path) -> None:
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0xFF
    p.write_bytes(b)


def _resume_all_damaged(t: Path) -> list[str]:
    ck = _with_run(t) / "checkpoints"
    _flip_byte(ck / "step_2" / "trainer" / "model" / "model.safetensors")
    _flip_byte(ck / "step_1" / "trainer" / "optimizer.safetensors")
    return ["train", *RUN_ARGS, "max_steps=4", "resume=auto"]


def _resume_other_dir_damaged(t: Path) -> list[str]:
    ck = _with_run(t) / "checkpoints"
    for step in ("step_1", "step_2"):
        (ck / step / "trainer" / "model" / "model.safetensors").unlink()
    return ["train", *RUN_ARGS[:-1], "run.name=other", "resume=runs/sat/done"]


def _resume_locked(t: Path) -> list[str]:
    _held_lock(_with_run(t))
    return ["train", *RUN_ARGS, "max_steps=4", "resume=auto"]


def _new_run_locked(t: Path) -> list[str]:
    _held_lock(t / "runs" / "sat" / "fresh")
    return ["train", *RUN_ARGS[:-1], "run.name=fresh"]


def _eval_damaged_ckpt(t: Path) -> list[str]:
    ck = _with_run(t) / "checkpoints" / "step_2"
    _flip_byte(ck / "trainer" / "model" / "model.safetensors")
    return ["eval", "toy", f"ckpt={ck.relative_to(t)}", "run.dir=runs"]


def _resume_legacy_incomplete(t: Path) -> list[str]:
    """Checkpoints from before manifests (none written) whose trainer state is gone."""
    for ck in (_with_run(t) / "checkpoints").iterdir():
        (ck / "manifest.json").unlink()
        (ck / "trainer" / "trainer_state.json").unlink()
    return ["train", *RUN_ARGS, "max_steps=4", "resume=auto"]


def _checkpoints_file(t: Path) -> list[str]:
    run = t / "runs" / "sat" / "r"
    run.mkdir(parents=True)
    (run / "checkpoints").write_text("not a folder\n")
    return ["train", "run.dir=runs", "run.name=r", "resume=auto", "max_steps=1"]


def _resume_below_checkpoint(t: Path) -> list[str]:
    _with_run(t)
    return ["train", *RUN_ARGS, "max_steps=1", "resume=auto"]


def _resume_changed_config(t: Path) -> list[str]:
    _with_run(t)
    return ["train", *RUN_ARGS, "seed=7", "task.samples_per_prompt=4", "resume=auto"]


# ---- issue 32: state files of the wrong shape, hostile files, sweeps that collide


def _legacy(t: Path) -> Path:
    """The finished run's checkpoints without manifests (as older runs wrote them): the schema
    checks must stand on their own."""
    ck = _with_run(t) / "checkpoints"
    for p in ck.iterdir():
        (p / "manifest.json").unlink()
    return ck


def _resume_wrong_shapes(t: Path) -> list[str]:
    from safetensors.torch import load_file, save_file

    ck = _legacy(t)
    (ck / "step_2" / "loop_state.json").write_text('{"step": null, "pending": []}')
    opt = ck / "step_1" / "trainer" / "optimizer.safetensors"
    sd = load_file(str(opt))
    key = sorted(k for k in sd if k.endswith("/exp_avg"))[0]
    sd[key] = sd[key].flatten()[:3].clone()
    save_file(sd, str(opt))
    return ["train", *RUN_ARGS, "max_steps=4", "resume=auto"]


def _resume_trainer_state_truncated(t: Path) -> list[str]:
    for p in _legacy(t).iterdir():
        state = p / "trainer" / "trainer_state.json"
        state.write_text(state.read_text()[:40])
    return ["train", *RUN_ARGS, "max_steps=4", "resume=auto"]


def _resume_other_trainer(t: Path) -> list[str]:
    _with_run(t)
    return ["train", *RUN_ARGS, "trainer=megatron", "max_steps=4", "resume=auto"]


def _sweep_state_list(t: Path) -> list[str]:
    (t / "runs" / "s").mkdir(parents=True)
    (t / "runs" / "s" / "sweep_state.json").write_text("[1, 2]")
    return [
        "sweep",
        _sweep(t, SWEEP.format(name="s", method="algo=grpo")),
        "run.dir=runs",
        "--dry-run",
    ]


def _fifo_model(t: Path) -> Path:
    m = _copy_model(t / "m")
    (m / "model.safetensors").unlink()
    os.mkfifo(m / "model.safetensors")
    return m


def _nan_model(t: Path) -> Path:
    import torch

    return _edit_weights(t / "m", lambda sd: sd["lm_head.weight"].fill_(torch.nan))


def _fifo_jsonl(t: Path) -> Path:
    (t / "data").mkdir()
    os.mkfifo(t / "data" / "rows.jsonl")
    return t / "data" / "rows.jsonl"


AXES = SWEEP.format(name="s", method="algo=grpo")


NEEDS_RUN = (
    "resume-state-files-wrong-shape",
    "resume-trainer-state-truncated",
    "resume-checkpoint-of-another-trainer",
    "resume-all-checkpoints-damaged",
    "resume-other-run-dir-damaged",
    "resume-run-locked-by-live-process",
    "resume-max-steps-below-checkpoint",
    "resume-changed-config",
    "eval-ckpt-damaged",
    "resume-legacy-checkpoints-incomplete",
)

BOMB = (
    "name: s\nbase: [experiment=cpu_smoke]\naxes: {}\nseeds: [0]\n"
    'a: &a ["x","x","x","x","x","x","x","x","x"]\n'
    + "".join(
        f"{c}: &{c} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]\n"
        for p, c in zip("abcdefgh", "bcdefghi", strict=True)
    )
    + "methods: {A: *i}\n"
)


def _sweep(root: Path, text: str) -> str:
    p = root / "sweep.yaml"
    p.write_text(text)
    return str(p)


# id -> (build(tmp) -> argv, exit code, regex the message must match)
CASES = {
    # ---- config overrides
    "unknown-key": (lambda t: ["config", "foo.bar=1"], 2, r"foo"),
    "bad-type": (lambda t: ["config", "max_steps=abc"], 2, r"max_steps"),
    "out-of-range": (lambda t: ["config", "max_steps=0"], 2, r"max_steps"),
    "unknown-group-option": (lambda t: ["config", "algo=nope"], 2, r"algo"),
    "negative-lag": (lambda t: ["config", "lag.n=-1"], 2, r"lag\.n"),
    "zero-lr": (lambda t: ["train", "trainer.lr=0"], 2, r"trainer\.lr"),
    "betas-length": (lambda t: ["train", "trainer.betas=[0.9]"], 2, r"trainer\.betas"),
    "top-p-above-1": (lambda t: ["train", "eval.top_p=1.5"], 2, r"eval\.top_p"),
    "malformed-override": (lambda t: ["train", "max_steps"], 2, r"max_steps"),
    "top-k-above-experts": (lambda t: ["train", "model.num_experts=1"], 2, r"model\.top_k"),
    "inflight-updates": (
        lambda t: ["train", "lag.inflight_updates=true", "run.dir=runs"],
        2,
        r"inflight_updates",
    ),
    # ---- run names and resume
    "run-name-traversal": (lambda t: ["train", "run.name=../../x"], 2, r"run\.name.*not a safe"),
    "run-experiment-traversal": (
        lambda t: ["train", "run.experiment=../x"],
        2,
        r"run\.experiment.*not a safe",
    ),
    "run-name-slash": (lambda t: ["train", "run.name=a/b"], 2, r"run\.name"),
    "run-name-dotdot": (lambda t: ["train", "run.name=.."], 2, r"run\.name"),
    "resume-nonexistent": (
        lambda t: ["train", "resume=" + str(t / "no" / "such" / "run")],
        2,
        r"resume=.*no complete checkpoint",
    ),
    "resume-empty-dir": (
        lambda t: ["train", "resume=" + str((t / "empty").mkdir() or t / "empty")],
        2,
        r"no complete checkpoint",
    ),
    "resume-corrupt-state": (_resume_corrupt, 2, r"loop_state\.json"),
    # ---- model paths
    "model-path-missing": (
        lambda t: ["train", "run.dir=runs", "model.path=" + str(t / "nonexistent")],
        2,
        r"model\.path=.*not a directory",
    ),
    "model-dir-no-config": (
        lambda t: ["train", "run.dir=runs", "model.path=" + str((t / "m").mkdir() or t / "m")],
        2,
        r"no config\.json",
    ),
    "model-pickle-only": (
        lambda t: [
            "train",
            "run.dir=runs",
            "model.path=" + str(_pickle_only(t / "m", t / MARKER)),
        ],
        2,
        r"only pickle weights \(pytorch_model\.bin\)",
    ),
    "model-hf-kind-pickle-only": (
        lambda t: [
            "train",
            "run.dir=runs",
            "model=qwen3_0_6b",
            "model.path=" + str(_pickle_only(t / "m", t / MARKER)),
        ],
        2,
        r"only pickle weights",
    ),
    "model-wrong-shapes": (
        lambda t: ["train", "run.dir=runs", "model.path=" + str(_wrong_shapes(t / "m"))],
        2,
        r"model\.embed_tokens\.weight.*\[128, 64\].*\[128, 128\]",
    ),
    "model-pickle-named-safetensors": (
        lambda t: [
            "train",
            "run.dir=runs",
            "model.path=" + str(_pickle_as_safetensors(t / "m", t / MARKER)),
        ],
        2,
        r"model\.safetensors is not a readable safetensors file",
    ),
    # ---- data files (sat eval jsonl eval.path=...)
    "data-missing-file": (
        lambda t: ["eval", "jsonl", "eval.path=" + str(t / "none.jsonl")],
        2,
        r"none\.jsonl: no such file",
    ),
    "data-malformed-json": (
        lambda t: [
            "eval",
            "jsonl",
            "eval.path=" + str(_jsonl(t, "bad.jsonl", GOOD_ROW + b'{"id": "b", "problem": \n')),
        ],
        2,
        r"bad\.jsonl:2",
    ),
    "data-missing-field": (
        lambda t: [
            "eval",
            "jsonl",
            "eval.path=" + str(_jsonl(t, "noans.jsonl", b'{"id": "a", "problem": "1+1?"}\n')),
        ],
        2,
        r"noans\.jsonl:1.*answer",
    ),
    "data-empty-file": (
        lambda t: ["eval", "jsonl", "eval.path=" + str(_jsonl(t, "empty.jsonl", b""))],
        2,
        r"empty\.jsonl: empty file",
    ),
    "data-wrong-encoding": (
        lambda t: [
            "eval",
            "jsonl",
            "eval.path="
            + str(
                _jsonl(
                    t,
                    "latin1.jsonl",
                    '{"id": "a", "problem": "café?", "answer": "1"}\n'.encode("latin-1"),
                )
            ),
        ],
        2,
        r"latin1\.jsonl:1.*UTF-8",
    ),
    "data-not-an-object": (
        lambda t: ["eval", "jsonl", "eval.path=" + str(_jsonl(t, "list.jsonl", b"[1, 2]\n"))],
        2,
        r"list\.jsonl:1.*JSON object",
    ),
    "data-duplicate-ids": (
        lambda t: ["eval", "jsonl", "eval.path=" + str(_jsonl(t, "dup.jsonl", GOOD_ROW * 2))],
        2,
        r"dup\.jsonl:2.*duplicate id",
    ),
    "eval-jsonl-without-path": (lambda t: ["eval", "jsonl"], 2, r"eval\.path"),
    "eval-unknown-benchmark": (lambda t: ["eval", "nope"], 2, r"eval"),
    "eval-override-as-benchmark": (lambda t: ["eval", "max_steps=3"], 2, r"first argument"),
    # ---- checkpoint dirs (sat eval toy ckpt=...)
    "ckpt-missing": (
        lambda t: ["eval", "toy", "ckpt=" + str(t / "nope")],
        2,
        r"ckpt=.*not a directory",
    ),
    "ckpt-without-model": (
        lambda t: ["eval", "toy", "ckpt=" + str((t / "ck").mkdir() or t / "ck")],
        2,
        r"not a training checkpoint",
    ),
    "ckpt-wrong-shapes": (
        lambda t: ["eval", "toy", "ckpt=" + str(_ckpt(t, _wrong_shapes))],
        2,
        r"model\.embed_tokens\.weight.*\[128, 64\]",
    ),
    "ckpt-pickle-weights": (
        lambda t: ["eval", "toy", "ckpt=" + str(_ckpt(t, lambda d: _pickle_only(d, t / MARKER)))],
        2,
        r"only pickle weights \(pytorch_model\.bin\)",
    ),
    "ckpt-truncated-safetensors": (
        lambda t: [
            "eval",
            "toy",
            "ckpt=" + str(_ckpt(t, lambda d: _truncate(_copy_model(d) / "model.safetensors"))),
        ],
        2,
        r"model\.safetensors is not a readable safetensors file",
    ),
    # ---- sweep files (sat sweep --dry-run)
    "sweep-missing-file": (
        lambda t: ["sweep", str(t / "none.yaml"), "--dry-run"],
        2,
        r"none\.yaml.*does not exist",
    ),
    "sweep-bad-yaml": (
        lambda t: ["sweep", _sweep(t, "name: [unclosed\n"), "--dry-run"],
        2,
        r"not valid YAML",
    ),
    "sweep-bad-method-override": (
        lambda t: [
            "sweep",
            _sweep(t, SWEEP.format(name="s", method="algo=nope")),
            "--dry-run",
        ],
        2,
        r"algo",
    ),
    "sweep-traversal-name": (
        lambda t: ["sweep", _sweep(t, SWEEP.format(name="../x", method="algo=grpo")), "--dry-run"],
        2,
        r"name must be a folder-safe word",
    ),
    # ---- issue 16: the config grammar (Hydra raised ValueError or accepted silently)
    "group-float": (lambda t: ["config", "lag=2.5"], 2, r"'lag=2\.5'.*config group 'lag'"),
    "group-huge-float": (lambda t: ["config", "lag=1e9"], 2, r"'lag=1e9'.*option name"),
    "group-null": (lambda t: ["config", "lag=null"], 2, r"'lag=null'.*not null"),
    "group-int": (lambda t: ["config", "algo=1"], 2, r"'algo=1'.*config group 'algo'"),
    "group-list": (lambda t: ["config", "lag=[1,2]"], 2, r"'lag=\[1,2\]'.*option name"),
    "plus-unknown-key": (
        lambda t: ["train", "+trainer.lrr=1e-4", "run.dir=runs"],
        2,
        r"unknown config key 'trainer\.lrr'",
    ),
    "plusplus-unknown-key": (
        lambda t: ["train", "++trainer.lrr=1e-4", "run.dir=runs"],
        2,
        r"unknown config key 'trainer\.lrr'",
    ),
    "plus-unknown-top-key": (lambda t: ["config", "+foo=1"], 2, r"unknown config key 'foo'"),
    "group-option-climbs-out": (
        lambda t: ["config", "algo=../clip/sat"],
        2,
        r"'algo=\.\./clip/sat'.*conf/algo/",
    ),
    "group-option-climbs-back-in": (
        lambda t: ["config", "algo=../../conf/algo/grpo"],
        2,
        r"conf/algo/",
    ),
    "sweep-axis-float-group": (
        lambda t: [
            "sweep",
            _sweep(t, SWEEP.format(name="s", method="algo=grpo").replace("{}", '{lag: "2.5,1e9"}')),
            "--dry-run",
        ],
        2,
        r"'lag=2\.5'.*option name",
    ),
    "sweep-axis-list-group": (
        lambda t: [
            "sweep",
            _sweep(t, SWEEP.format(name="s", method="algo=grpo").replace("{}", '{lag: "[1,2]"}')),
            "--dry-run",
        ],
        2,
        r"'lag=\[1,2\]'.*option name",
    ),
    "sweep-method-plus-unknown-key": (
        lambda t: [
            "sweep",
            _sweep(t, SWEEP.format(name="s", method="+trainer.lrr=1")),
            "--dry-run",
        ],
        2,
        r"unknown config key 'trainer\.lrr'",
    ),
    "sweep-yaml-alias-bomb": (
        lambda t: ["sweep", _sweep(t, BOMB), "--dry-run"],
        2,
        r"expands to more than 100000 YAML nodes",
    ),
    # ---- messages that name the real cause
    "seed-above-int64": (
        lambda t: ["train", "seed=99999999999999999999", "run.dir=runs"],
        2,
        r"sat: error: 'seed=99999999999999999999': 99999999999999999999… is beyond a 64-bit integer",
    ),
    "task-jsonl-without-path": (
        lambda t: ["train", "task.kind=jsonl", "run.dir=runs"],
        2,
        r"task\.kind=jsonl needs task\.path",
    ),
    "megatron-context-parallel": (
        lambda t: [
            "train",
            "trainer=megatron",
            "trainer.cp=2",
            "trainer.nproc_per_node=2",
            "run.dir=runs",
        ],
        2,
        r"sat: error: .*trainer=megatron cannot run trainer\.cp=2",
    ),
    "megatron-tp-not-dividing-ranks": (
        lambda t: [
            "train",
            "trainer=megatron",
            "trainer.tp=2",
            "trainer.nproc_per_node=3",
            "run.dir=runs",
        ],
        2,
        r"sat: error: trainer=megatron: trainer\.tp × trainer\.pp × trainer\.cp = 2 × 1 × 1 "
        r"must divide the number of ranks \(trainer\.nproc_per_node × trainer\.nnodes = 3\)",
    ),
    "megatron-ep-not-dividing-ranks": (
        lambda t: ["train", "trainer=megatron", "trainer.ep=3", "run.dir=runs"],
        2,
        r"sat: error: trainer=megatron: trainer\.ep=3 must divide",
    ),
    # ---- run folders
    "run-name-300-chars": (
        lambda t: ["train", "run.name=" + "n" * 300, "run.dir=runs"],
        2,
        r"run\.name is 300 bytes long.*at most 255",
    ),
    "run-dir-is-a-file": (
        lambda t: ["train", "run.dir=" + _file(t, "afile"), "max_steps=1"],
        2,
        r"run folder afile/sat/.*afile is a file, not a folder",
    ),
    "eval-run-dir-is-a-file": (
        lambda t: ["eval", "toy", "run.dir=" + _file(t, "afile")],
        2,
        r"evaluation folder afile/eval/.*is a file, not a folder",
    ),
    "sweep-run-dir-is-a-file": (
        lambda t: [
            "sweep",
            _sweep(t, SWEEP.format(name="s", method="algo=grpo")),
            "run.dir=" + _file(t, "afile"),
        ],
        2,
        r"sweep folder afile/s.*is a file, not a folder",
    ),
    "new-run-locked-by-live-process": (
        _new_run_locked,
        2,
        rf"run folder runs/sat/fresh is in use by pid {os.getpid()}",
    ),
    # ---- weights checked completely (transformers filled missing ones with random values)
    "model-missing-head-and-layer": (
        lambda t: [
            "train",
            "run.dir=runs",
            "model.path=" + str(_edit_weights(t / "m", _drop_head_and_layer)),
        ],
        2,
        r"tensor\(s\) missing: 'lm_head\.weight', 'model\.layers\.3\.",
    ),
    "model-missing-one-expert": (
        lambda t: [
            "train",
            "run.dir=runs",
            "model.path=" + str(_edit_weights(t / "m", _drop_one_expert)),
        ],
        2,
        r"1 tensor\(s\) missing: 'model\.layers\.0\.mlp\.experts\.5\.up_proj\.weight'",
    ),
    "model-unexpected-tensor": (
        lambda t: [
            "train",
            "run.dir=runs",
            "model.path=" + str(_edit_weights(t / "m", _add_tensor)),
        ],
        2,
        r"1 unexpected tensor\(s\): 'model\.layers\.0\.mlp\.shared_expert\.weight'",
    ),
    "model-integer-tensor": (
        lambda t: [
            "train",
            "run.dir=runs",
            "model.path=" + str(_edit_weights(t / "m", _int_tensor)),
        ],
        2,
        r"tensor 'model\.norm\.weight' is stored as I32 but the model needs float32",
    ),
    "model-missing-shard": (
        lambda t: ["train", "run.dir=runs", "model.path=" + str(_missing_shard(t / "m"))],
        2,
        r"names weight file\(s\) that are missing: 'model-00002-of-00002\.safetensors'",
    ),
    "eval-model-missing-head": (
        lambda t: [
            "eval",
            "toy",
            "model.path=" + str(_edit_weights(t / "m", _drop_head_and_layer)),
        ],
        2,
        r"missing: 'lm_head\.weight'",
    ),
    "ckpt-missing-head": (
        lambda t: [
            "eval",
            "toy",
            "ckpt=" + str(_ckpt(t, lambda d: _edit_weights(d, _drop_head_and_layer))),
        ],
        2,
        r"ckpt=.*missing: 'lm_head\.weight'",
    ),
    "model-without-tokenizer": (
        lambda t: [
            "train",
            "run.dir=runs",
            "model.path=" + str(_tokenizer_damage(t / "m", "missing")),
        ],
        2,
        r"has no tokenizer files",
    ),
    "model-truncated-tokenizer": (
        lambda t: [
            "train",
            "run.dir=runs",
            "model.path=" + str(_tokenizer_damage(t / "m", "truncated")),
        ],
        2,
        r"cannot load the tokenizer of",
    ),
    # ---- evaluation rows parsed defensively, prompts bounded by the context
    "data-deep-nesting": (
        lambda t: [
            "eval",
            "jsonl",
            "eval.path="
            + str(
                _jsonl(
                    t,
                    "deep.jsonl",
                    b'{"id": "a", "problem": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
                )
            ),
        ],
        2,
        r"deep\.jsonl:1: JSON nested too deeply",
    ),
    "data-nesting-over-limit": (
        lambda t: [
            "eval",
            "jsonl",
            "eval.path="
            + str(
                _jsonl(t, "d40.jsonl", GOOD_ROW[:-2] + b', "x": ' + b"[" * 40 + b"]" * 40 + b"}\n")
            ),
        ],
        2,
        r"d40\.jsonl:1: JSON nested more than 32 levels",
    ),
    "data-5000-digit-integer": (
        lambda t: [
            "eval",
            "jsonl",
            "eval.path="
            + str(
                _jsonl(
                    t, "big.jsonl", b'{"id": "a", "problem": "p", "answer": ' + b"7" * 5000 + b"}\n"
                )
            ),
        ],
        2,
        r"big\.jsonl:1: unusable JSON value \(an integer with more than 4300 digits\)",
    ),
    "data-lone-surrogate": (
        lambda t: [
            "eval",
            "jsonl",
            "eval.path="
            + str(_jsonl(t, "sur.jsonl", b'{"id": "a", "problem": "x\\ud800y", "answer": "1"}\n')),
        ],
        2,
        r"sur\.jsonl:1: field 'problem' .*lone UTF-16 surrogate",
    ),
    "data-nan-answer": (
        lambda t: [
            "eval",
            "jsonl",
            "eval.path="
            + str(_jsonl(t, "nan.jsonl", b'{"id": "a", "problem": "p", "answer": NaN}\n')),
        ],
        2,
        r"nan\.jsonl:1: unusable JSON value \(NaN",
    ),
    "eval-prompt-1mb": (
        lambda t: [
            "eval",
            "jsonl",
            "eval.path="
            + str(
                _jsonl(
                    t,
                    "long.jsonl",
                    b'{"id": "a", "problem": "'
                    + b"8" * 600
                    + b'", "answer": "1"}\n'
                    + b'{"id": "b", "problem": "'
                    + b"9" * 1_000_000
                    + b'", "answer": "1"}\n',
                )
            ),
        ],
        2,
        r"2 of 2 evaluation problems \('a', 'b'\) are longer than 511 tokens.*nothing the model can",
    ),
    "train-template-longer-than-context": (
        lambda t: [
            "train",
            "task.template='" + "x" * 600 + "{problem}'",
            "max_steps=1",
            "run.dir=runs",
        ],
        2,
        r"task prompts have more than 511 tokens",
    ),
    # ---- resume over a real finished run: refused, nothing changed, MLflow status FINISHED
    "resume-all-checkpoints-damaged": (
        _resume_all_damaged,
        2,
        r"no usable checkpoint under runs/sat/done/checkpoints: step_2: trainer/model/model\."
        r"safetensors does not match its SHA-256.*step_1: trainer/optimizer\.safetensors",
    ),
    "resume-other-run-dir-damaged": (
        _resume_other_dir_damaged,
        2,
        r"no usable checkpoint under runs/sat/done/checkpoints: step_2: trainer/model/model\."
        r"safetensors is missing",
    ),
    "resume-run-locked-by-live-process": (
        _resume_locked,
        2,
        rf"run folder runs/sat/done is in use by pid {os.getpid()}",
    ),
    "eval-ckpt-damaged": (
        _eval_damaged_ckpt,
        2,
        r"ckpt='runs/sat/done/checkpoints/step_2' is damaged: trainer/model/model\.safetensors "
        r"does not match its SHA-256",
    ),
    # ---- found by the fresh hostile pass after the fixes above
    "delete-schema-key": (lambda t: ["config", "~seed"], 2, r"'~seed' deletes 'seed'"),
    "unknown-template": (
        lambda t: ["config", "task.template=nope"],
        2,
        r"task\.template='nope' is neither a template name",
    ),
    "run-name-control-character": (
        lambda t: ["config", "run.name='a\nb'"],
        2,
        r"run\.name='a\\nb'\" has a control character",
    ),
    "data-50mb-prompt": (
        lambda t: [
            "eval",
            "jsonl",
            "eval.path="
            + str(
                _jsonl(
                    t,
                    "huge.jsonl",
                    b'{"id": "a", "problem": "' + b"x" * 50_000_000 + b'", "answer": "1"}\n',
                )
            ),
        ],
        2,
        r"1 of 1 evaluation problems \('a'\) are longer than 511 tokens",
    ),
    "run-checkpoints-is-a-file": (
        _checkpoints_file,
        2,
        r"run folder runs/sat/r: runs/sat/r/checkpoints is a file, not a folder",
    ),
    "resume-legacy-checkpoints-incomplete": (
        _resume_legacy_incomplete,
        2,
        r"no usable checkpoint .*step_2: trainer/trainer_state\.json is missing",
    ),
    "resume-max-steps-below-checkpoint": (
        _resume_below_checkpoint,
        2,
        r"max_steps=1 is below the step 2 of the checkpoint",
    ),
    # issue 45: resume=auto continued a run with another config without a word
    "resume-changed-config": (
        _resume_changed_config,
        2,
        r"differs from the run's runs/sat/done/config\.yaml in 2 key\(s\): seed: 0 -> 7; "
        r"task\.samples_per_prompt: 2 -> 4\..*resume=force",
    ),
    # ---- issue 32: state files checked against schemas before the run folder is touched
    "resume-state-files-wrong-shape": (
        _resume_wrong_shapes,
        2,
        r"no usable checkpoint .*step_2: loop_state\.json: step: expected an integer >= 0, got "
        r"null; step_1: trainer/optimizer\.safetensors: 'state/\d+/exp_avg' has shape \[3\]",
    ),
    "resume-trainer-state-truncated": (
        _resume_trainer_state_truncated,
        2,
        r"no usable checkpoint .*step_2: trainer/trainer_state\.json is unreadable \(JSONDecode",
    ),
    "resume-checkpoint-of-another-trainer": (
        _resume_other_trainer,
        2,
        r"was written by another trainer than the one configured \(backend: 'local' in the "
        r"checkpoint, 'megatron' now\)",
    ),
    "sweep-state-not-an-object": (
        _sweep_state_list,
        2,
        r"cannot use sweep state runs/s/sweep_state\.json: sweep_state\.json: expected an "
        r"object, got list",
    ),
    # ---- sweeps: colliding runs, grids too large to expand
    "sweep-axis-collides-with-base": (
        lambda t: [
            "sweep",
            _sweep(
                t, AXES.replace("{}", '{lag: "1,8"}').replace("cpu_smoke]", "cpu_smoke, lag.n=2]")
            ),
            "--dry-run",
        ],
        2,
        r"runs 'a-lag1-s0' and 'a-lag8-s0' are the same config .*base: lag\.n=2 sets the same",
    ),
    "sweep-two-methods-one-config": (
        lambda t: [
            "sweep",
            _sweep(t, AXES.replace("  A: [algo=grpo]", "  A: [algo=grpo]\n  B: [clip=sat]")),
            "--dry-run",
        ],
        2,
        r"runs 'a-s0' and 'b-s0' are the same config",
    ),
    "sweep-grid-too-large": (
        lambda t: [
            "sweep",
            _sweep(t, AXES.replace("{}", '{lag.n: "range(0,1000000000)"}')),
            "--dry-run",
        ],
        2,
        r"the grid has 1000000000 runs .*more than max_runs=2000",
    ),
    # ---- numbers, settings of another command, combinations
    "nan-setting": (
        lambda t: ["plan", "trainer=megatron", "trainer.gpu_memory_gb=nan"],
        2,
        r"trainer\.gpu_memory_gb=nan is not a finite number",
    ),
    "inf-setting": (
        lambda t: ["train", "engine=sglang", "engine.request_timeout_s=inf", "run.dir=runs"],
        2,
        r"engine\.request_timeout_s=inf is not a finite number",
    ),
    "setting-of-another-command": (
        lambda t: ["train", "ckpt=runs/x", "run.dir=runs"],
        2,
        r"'ckpt=runs/x': ckpt is a setting of `sat eval`; `sat train` does not use it",
    ),
    "eval-with-a-training-setting": (
        lambda t: ["eval", "toy", "resume=auto"],
        2,
        r"resume is a setting of `sat train` and `sat plan`; `sat eval` does not use it",
    ),
    "megatron-dense-model-with-r3": (
        lambda t: ["plan", "trainer=megatron", "model=qwen3_0_6b", "r3=true"],
        2,
        r"r3=true needs a Mixture-of-Experts model",
    ),
    "tiny-model-other-task": (
        lambda t: ["config", "task=gsm8k"],
        2,
        r"model=tiny_moe is warm-started on the toy task or a file of yours \(task\.path=<file>\) only; task\.kind=gsm8k needs model\.path",
    ),
    "group-option-interpolation-climbs-out": (
        lambda t: ["config", "algo=${oc.env:HOME}"],
        2,
        r"'algo=\$\{oc\.env:HOME\}' \(resolves to '/.*conf/algo/ \(no '\.\.', no absolute path\)",
    ),
    # ---- hostile files
    "model-file-is-a-fifo": (
        lambda t: ["train", "run.dir=runs", "model.path=" + str(_fifo_model(t))],
        2,
        r"'model\.safetensors' is not a regular file \(a FIFO",
    ),
    "model-weights-nan": (
        lambda t: ["eval", "toy", "model.path=" + str(_nan_model(t))],
        2,
        r"1 tensor\(s\) hold NaN or infinite values \('lm_head\.weight'",
    ),
    "data-file-is-a-fifo": (
        lambda t: ["eval", "jsonl", "eval.path=" + str(_fifo_jsonl(t))],
        2,
        r"rows\.jsonl: is a FIFO, not a regular file",
    ),
    # ---- resources (exit 1: a limit of the machine, not the input)
    "address-space-below-2gib": (
        lambda t: ["train", "run.dir=runs", "max_steps=1"],
        1,
        r"the address-space limit of this process is 1\.00 GiB \(ulimit -v 1048576\)",
    ),
}

# per case: a memory cap for the child (the alias bomb would exhaust the machine otherwise)
LIMITS = {
    "sweep-yaml-alias-bomb": 4 << 30,
    "data-50mb-prompt": 4 << 30,
    "address-space-below-2gib": 1 << 30,
}


def _truncate(p: Path) -> Path:
    data = p.read_bytes()
    p.write_bytes(data[:20])  # the 8-byte header length says far more than what follows
    return p


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A real finished run (2 steps, checkpoints step_1 and step_2, MLflow run FINISHED)."""
    root = tmp_path_factory.mktemp("finished")
    out = _sat(["train", *RUN_ARGS], root, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    _FINISHED[:] = [root / "runs"]
    return root / "runs"


def _sat(argv: list[str], cwd: Path, timeout: float = 600, mem: int | None = None):
    def preexec():
        if mem:
            resource.setrlimit(resource.RLIMIT_AS, (mem, mem))

    return subprocess.run(
        [sys.executable, "-m", "sat_cli.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=preexec,
    )


def _statuses(runs: Path) -> list[str]:
    from mlflow import MlflowClient

    c = MlflowClient(tracking_uri=f"sqlite:///{runs / 'mlflow.db'}")
    return [r.info.status for r in c.search_runs([e.experiment_id for e in c.search_experiments()])]


# The default suite (`make test`) runs one or two cases of each class of bad input, each a real
# `sat` subprocess (2-30 s); `make test-full` runs every case. A class: the override grammar and
# types, ranges, combinations `sat train` cannot run, data files, model folders, checkpoints,
# resume targets (the damaged files of a real finished run: make test-full), run folders and
# names, a run folder a live run holds, sweep files, `sat eval`'s inputs. The in-process checks behind most cases run
# per case in tests/test_config.py, test_data.py, test_state_and_inputs.py and test_cli.py.
DEFAULT_CASES = {
    "bad-type",  # the override grammar and types
    "unknown-key",
    "group-option-climbs-out",
    "negative-lag",  # ranges
    "inflight-updates",  # combinations
    "megatron-tp-not-dividing-ranks",
    "data-malformed-json",  # data files
    "data-lone-surrogate",
    "model-pickle-only",  # model folders
    "model-missing-head-and-layer",
    "ckpt-pickle-weights",  # checkpoints
    "resume-nonexistent",  # resume targets
    "resume-corrupt-state",
    "run-name-traversal",  # run folders and names
    "run-dir-is-a-file",
    "new-run-locked-by-live-process",  # a live run's folder
    "sweep-bad-yaml",  # sweep files
    "sweep-yaml-alias-bomb",
    "sweep-grid-too-large",
    "eval-unknown-benchmark",  # sat eval
}


@pytest.mark.parametrize(
    "case",
    [c if c in DEFAULT_CASES else pytest.param(c, marks=pytest.mark.slow) for c in sorted(CASES)],
)
def test_bad_input_is_refused_cleanly(case, tmp_path, request):
    build, code, pattern = CASES[case]
    if case in NEEDS_RUN:
        request.getfixturevalue("finished_run")
    try:
        argv = build(tmp_path)
        before = _tree(tmp_path)
        out = _sat(argv, tmp_path, mem=LIMITS.get(case))
    finally:
        while _HELD:
            _HELD.pop().release()
    err = out.stderr
    assert out.returncode == code, (out.stdout[-2000:], err[-3000:])
    assert "Traceback" not in err + out.stdout
    assert "sat: error:" in err
    assert re.search(pattern, err, re.S), err[-3000:]
    after = _tree(tmp_path)
    if case in ("new-run-locked-by-live-process", "resume-run-locked-by-live-process"):
        lock = [k for k in before if k.endswith(".sat.lock")]
        assert lock and all(k not in after for k in lock)  # the holder released it since
        before = {k: v for k, v in before.items() if k not in lock}
    assert after == before  # nothing written: no run dir, store, cache, config or checkpoint
    assert not (tmp_path / MARKER).exists()  # no pickle was ever loaded
    if case in NEEDS_RUN:
        assert _statuses(tmp_path / "runs") == ["FINISHED"]


def test_every_default_case_is_in_the_catalogue():
    assert DEFAULT_CASES <= set(CASES), sorted(DEFAULT_CASES - set(CASES))


def test_every_catalogue_case_is_documented():
    """docs/reliability.md lists the refused inputs: each issue-16 case id appears there."""
    doc = (REPO / "docs" / "reliability.md").read_text()
    missing = [c for c in CASES if c not in doc and c in _ISSUE16]
    assert not missing, missing


_ISSUE16 = set(list(CASES)[list(CASES).index("group-float") :])


# ----------------------------------------------------------------------------- security


def _py_files() -> list[Path]:
    return sorted((REPO / "sat_cli").rglob("*.py"))


def _calls(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node


def _name(func: ast.AST) -> str:
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        parts.append(func.id)
    return ".".join(reversed(parts))


def test_no_shell_and_no_unpickling_anywhere():
    """AST scan of sat_cli: no shell=True, os.system/popen, pickle.load(s), torch.load without
    weights_only=True, or eval/exec."""
    bad = []
    for path in _py_files():
        rel = path.relative_to(REPO)
        for call in _calls(path):
            name = _name(call.func)
            kw = {k.arg: k.value for k in call.keywords}
            shell = kw.get("shell")
            if isinstance(shell, ast.Constant) and shell.value is True:
                bad.append(f"{rel}:{call.lineno} shell=True")
            if name in ("os.system", "os.popen", "pickle.load", "pickle.loads", "marshal.loads"):
                bad.append(f"{rel}:{call.lineno} {name}")
            if isinstance(call.func, ast.Name) and name in ("eval", "exec"):
                bad.append(f"{rel}:{call.lineno} {name}")
            if name == "torch.load" or name.endswith(".torch.load"):
                wo = kw.get("weights_only")
                if not (isinstance(wo, ast.Constant) and wo.value is True):
                    bad.append(f"{rel}:{call.lineno} torch.load without weights_only=True")
    assert not bad, bad


def test_subprocess_commands_are_argument_lists():
    """Every subprocess.run/Popen/call/check_* call gets a list (or a name bound to one), never
    a string."""
    bad = []
    for path in _py_files():
        for call in _calls(path):
            name = _name(call.func)
            if name.split(".")[-1] in ("run", "Popen", "call", "check_call", "check_output") and (
                name.startswith("subprocess.")
            ):
                arg = call.args[0] if call.args else None
                if isinstance(arg, ast.Constant | ast.JoinedStr | ast.BinOp):
                    bad.append(f"{path.relative_to(REPO)}:{call.lineno}")
    assert not bad, bad


def test_servers_bind_loopback_by_default():
    """No 0.0.0.0 / '::' anywhere in sat_cli; every `host` default is 127.0.0.1; `sat ui`
    builds an mlflow server command line with --host 127.0.0.1."""
    hits = [
        f"{p.relative_to(REPO)}:{i}"
        for p in _py_files()
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"""["'](0\.0\.0\.0|::)["']""", line)
    ]
    assert not hits, hits
    defaults = []
    for path in _py_files():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                positional = node.args.posonlyargs + node.args.args
                args = positional + node.args.kwonlyargs
                dflt = [None] * (len(positional) - len(node.args.defaults)) + list(
                    node.args.defaults
                )
                dflt += list(node.args.kw_defaults)
                for a, d in zip(args, dflt, strict=True):
                    if a.arg in ("host", "bind", "address") and d is not None:
                        val = d.value if isinstance(d, ast.Constant) else None
                        # typer.Option("127.0.0.1", ...) in the CLI
                        # typer.Option("127.0.0.1", ...) or the typed layer's
                        # opt(SPEC, "127.0.0.1", ...): the call's first string constant
                        if isinstance(d, ast.Call):
                            consts = [x.value for x in d.args if isinstance(x, ast.Constant)]
                            val = next((v for v in consts if isinstance(v, str)), None)
                        defaults.append((f"{path.relative_to(REPO)}:{node.name}", val))
            if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "host":
                value = getattr(node.value, "value", None)
                if not isinstance(value, int | float):  # a number is host memory, not an address
                    defaults.append((f"{path.relative_to(REPO)}:{node.lineno}", value))
    assert defaults, "no host defaults found: the scan is broken"
    assert all(v == "127.0.0.1" for _, v in defaults), defaults

    from sat_cli.tracking import ui_command

    cmd = ui_command("sqlite:///runs/mlflow.db")
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert isinstance(cmd, list) and all(isinstance(c, str) for c in cmd)


def test_sat_ui_help_says_loopback():
    out = CliRunner().invoke(app, ["ui", "--help"])
    assert out.exit_code == 0 and "127.0.0.1" in out.output


def _secret_params(tmp_path) -> dict[str, str]:
    """Params of a run stored through the real Tracker into a sqlite store: the flattened
    resolved config (as `sat train` logs it) with an API key after a flag in
    engine.extra_args, a password in a URI, and secret-named keys."""
    from mlflow import MlflowClient
    from omegaconf import OmegaConf

    from sat_cli.config import compose
    from sat_cli.tracking import Tracker, TrackerSettings, flatten_config

    db = seeded_store(tmp_path / "mlflow.db")
    cfg = compose(
        [
            "engine=sglang",
            "engine.extra_args=[--api-key,SECRET123,--log-level,info]",
            "data.dir=https://user:SECRETPW@example.org/data",
        ]
    )
    container = OmegaConf.to_container(cfg, resolve=True)
    container["engine"]["api_key"] = "SECRET456"  # keys named like credentials
    container["data"]["hf_token"] = "SECRET789"
    container["tracking"]["auth"] = {"password": "SECRETAUTH"}
    with Tracker(
        TrackerSettings(f"sqlite:///{db}", "sec"), "r", params=flatten_config(container)
    ) as tr:
        run_id = tr.run_id
    return MlflowClient(tracking_uri=f"sqlite:///{db}").get_run(run_id).data.params


def test_secret_keys_and_uri_passwords_never_reach_mlflow_params(tmp_path):
    stored = _secret_params(tmp_path)
    dump = "\n".join(f"{k}={v}" for k, v in stored.items())
    for secret in ("SECRET456", "SECRET789", "SECRETPW", "SECRETAUTH"):
        assert secret not in dump
    assert stored["engine.api_key"] == "***" and stored["data.hf_token"] == "***"
    assert stored["tracking.auth"] == "***"
    assert stored["data.dir"] == "https://user:***@example.org/data"
    assert stored["engine.extra_args"].startswith('["--api-key"')


def test_secret_after_flag_in_argument_list_is_masked(tmp_path):
    stored = _secret_params(tmp_path)
    assert "SECRET123" not in stored["engine.extra_args"]


def test_pickle_payload_would_fire_if_loaded(tmp_path):
    """The marker check above means something: unpickling the payload does create the marker."""
    pickle.loads(pickle.dumps(_Payload(str(tmp_path / MARKER))))  # noqa: S301 - the point
    assert (tmp_path / MARKER).is_dir()


@pytest.mark.parametrize(
    "command",
    [
        "train",
        pytest.param("eval", marks=pytest.mark.slow),
        pytest.param("sweep", marks=pytest.mark.slow),
    ],
)
def test_read_only_run_dir_is_refused(command, tmp_path, fsfault):
    """run.dir on a read-only file system (which stops root too) or, for a non-root user, a
    folder without write permission: exit 2 naming it, nothing written, no traceback."""
    ro = tmp_path / "ro"
    kind = fsfault.read_only_dir(ro)
    if kind is None:
        pytest.skip("no read-only folder possible here (root without mount rights)")
    argv = {
        "train": ["train", "run.dir=ro", "max_steps=1"],
        "eval": ["eval", "toy", "run.dir=ro"],
        "sweep": [
            "sweep",
            _sweep(tmp_path, SWEEP.format(name="s", method="algo=grpo")),
            "run.dir=ro",
        ],
    }[command]
    before = _tree(tmp_path)
    out = _sat(argv, tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    want = "is on a read-only file system" if kind == "tmpfs-ro" else "is not writable"
    assert re.search(rf"sat: error: \w+ folder ro/.*ro {want}", out.stderr), out.stderr
    assert _tree(tmp_path) == before
