"""One definition of the metric names shared between modules (``sat_cli.metric_names``): the
names are well formed and distinct, a real trainer step reports them, and no other module
spells one of them as a string literal (so a rename cannot leave a reader behind)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import torch

import sat_cli
from sat_cli import metric_names as M
from sat_cli.engines.base import Sample
from sat_cli.models.tiny_moe import build_char_tokenizer, build_tiny_moe, save_hf
from sat_cli.rl.config import LossConfig
from sat_cli.trainers.batch import collate
from sat_cli.trainers.local import LocalTrainer

PKG = Path(sat_cli.__file__).parent


# every metric group: a string (or an f-string's leading text) starting "<group>/" outside
# metric_names.py is a metric name spelled by hand
GROUPS = (
    *("loss", "staleness", "rollout", "sat", "perf", "eval", "final", "vcpo", "a3po", "r3"),
    *("sweep", "tracking", "weights", "clip", "opt", "reward"),
    "dynamic",
)
GROUP_PREFIX = re.compile(rf"({'|'.join(GROUPS)})/")


def _names() -> dict[str, str]:
    """The metric and histogram names (not the group prefixes, patterns or artifact paths)."""
    return {
        k: v
        for k, v in vars(M).items()
        if k.isupper()
        and isinstance(v, str)
        and "/" in v
        and "{" not in v
        and not v.endswith("/")
        and not k.startswith("ARTIFACT_")
    }


def test_names_are_distinct_and_well_formed():
    names = _names()
    assert len(set(names.values())) == len(names)
    for const, name in names.items():
        assert re.fullmatch(r"[a-z0-9]+/[a-z0-9_]+", name), const
    assert set(M.STEP_NAMES) <= set(names.values())
    assert M.avg_key("toy", 8) == "eval/toy/avg@8"
    assert M.avg_key("aime24", 8, final=True) == "final/aime24/avg@8"
    assert M.pass_key("toy", 4) == "eval/toy/pass@4"
    assert M.overlong_key("aime24", final=True) == "final/aime24/overlong"
    for const, name in vars(M).items():
        if const.isupper() and isinstance(name, str) and GROUP_PREFIX.match(name):
            assert name.split("/")[0] in GROUPS, const
    assert M.ABS_LOGRATIO_PCT.format("p90") == "staleness/abs_logratio_p90"


def test_a_trainer_step_reports_the_shared_names(tmp_path):
    ckpt = save_hf(build_tiny_moe(2), build_char_tokenizer(), tmp_path / "v0")
    g = torch.Generator().manual_seed(0)
    samples = [
        Sample(
            [5, 6, 7],
            [8, 9, 10, 11],
            (-3.0 + 0.3 * torch.randn(4, generator=g)).tolist(),
            "stop",
            0,
        )
        for _ in range(4)
    ]
    batch = collate(samples, torch.tensor([1.0, -1.0, 0.5, -0.5]), pad_id=0)
    metrics = LocalTrainer(str(ckpt), loss=LossConfig(adaptive=True, kl_coef=0.1)).step(batch)
    missing = [n for n in (*M.STEP_NAMES, M.KL_REF) if n not in metrics]
    assert missing == []
    assert metrics[M.SAT_Q] > 0 and 0.0 <= metrics[M.CLIPFRAC] <= 1.0


def _literals(tree: ast.AST) -> list[tuple[int, str]]:
    """String constants of a module that are not docstrings, and the leading text of each
    f-string (``f"sat/{k}"`` gives ``"sat/"``)."""
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docs.add(id(body[0].value))
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.JoinedStr):
            docs.update(id(v) for v in n.values)  # judged as one string, by its leading text
            head = n.values[0] if n.values else None
            if isinstance(head, ast.Constant) and isinstance(head.value, str):
                out.append((n.lineno, head.value))
    out += [
        (n.lineno, n.value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
    ]
    return out


def _offenders(source: str) -> list[tuple[int, str]]:
    shared = set(_names().values())
    return [
        (line, value)
        for line, value in _literals(ast.parse(source))
        if value in shared or GROUP_PREFIX.match(value)
    ]


def test_no_module_spells_a_metric_name():
    """Every metric name (any ``<group>/…`` string, f-strings included) comes from
    metric_names.py; docstrings are free to mention them."""
    offenders = []
    for path in sorted(PKG.rglob("*.py")):
        if path.name == "metric_names.py":
            continue
        for line, value in _offenders(path.read_text()):
            offenders.append(f"{path.relative_to(PKG)}:{line}: {value!r}")
    assert offenders == []


def test_the_scan_sees_fstrings_and_literals():
    src = '"""doc: sat/q"""\nx = {f"sat/{k}": 1, "perf/step_s": 2, "q": 3}\ny = f"{p}/avg"\n'
    assert sorted(v for _, v in _offenders(src)) == ["perf/step_s", "sat/"]
