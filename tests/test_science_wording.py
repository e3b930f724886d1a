"""The science write-up (README.md, docs/results/, docs/sweeps.md, the sweep files' comments)
says what the committed data say (issue 30, item 6): no phrase that contradicts them comes back,
every number quoted outside a generated block equals the committed CSV's, the run counts equal
the sweep files' expansion and the inert threshold is the two-sided one. Text checks over
committed files; the sweep files are expanded, not composed (well under a second)."""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path

import pytest

from sat_cli.sweep.spec import load_sweep

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
SWEEPS = [
    "paper_table1",
    "paper_table1_cpu",
    "regime_map_cpu",
    "sat_power_cpu",
    "sat_power_lr_check_cpu",
    "smoke",
]
WRITE_UP = [
    ROOT / "README.md",
    ROOT / "docs" / "sweeps.md",
    RESULTS / "README.md",
    RESULTS / "sat_power_cpu.md",
    *(ROOT / "sweeps" / f"{name}.yaml" for name in SWEEPS),
]


def _text(path: Path) -> str:
    """The file with its whitespace (line breaks, a YAML comment's '#') folded to single spaces."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".yaml":
        text = re.sub(r"^#\s?", "", text, flags=re.M)
    return " ".join(text.split())


def _pair(kind: str, a: str, b: str, endpoint: str) -> dict[str, str]:
    with open(RESULTS / "sat_power_cpu" / "pairs.csv", newline="") as f:
        for r in csv.DictReader(f):
            if (r["kind"], r["a"], r["b"], r["endpoint"]) == (kind, a, b, endpoint):
                return r
    raise AssertionError(f"no pair {a} − {b} ({endpoint}) in pairs.csv")


def _ci(r: dict[str, str]) -> str:
    return f"[{float(r['ci95_lo']):+.2f}, {float(r['ci95_hi']):+.2f}]"


@pytest.mark.parametrize(
    "phrase",
    [
        "lag failure the paper reports",  # the paper marks only plain GRPO / GSPO as collapsing
        "lag-robust",  # the powered test measures a lag cost for GRPO at the same lr
        "24 of 24",  # counted repeated pairs
        "reproduces and extends",  # README: the project tests the paper, it does not reproduce it
        "reproduction of the paper",
        "mechanism reproduces",  # no uniform-tightening control has run
        "not been run yet",  # docs/sweeps.md: the CPU grid ran
        "table (56 runs)",  # docs/sweeps.md: the CPU grid has 68 runs (56 was issue 11's grid)
        "56 runs ×",
        "trains from scratch instead of using",  # sweeps use the shipped warm start
        "when q >= ln(1+eps) it is bit-identical",  # inert only from max(l_high, l_low)
    ],
)
def test_no_contradicted_phrase_is_back(phrase):
    hits = [str(p.relative_to(ROOT)) for p in WRITE_UP if phrase.lower() in _text(p).lower()]
    assert hits == []


def test_readme_says_what_the_cpu_study_found_and_does_not_claim_to_reproduce_the_paper():
    readme = ROOT / "README.md"
    for line in readme.read_text(encoding="utf-8").splitlines():
        if "reproduc" in line.lower():  # bit-for-bit reruns are fine; the paper's results are not
            assert not re.search(r"paper|SAT\b|Table 1|arXiv", line), line
    text = _text(readme)
    assert "**no benefit at CPU scale**" in text
    assert "(docs/results/collapse_cpu.md)" in text and (RESULTS / "collapse_cpu.md").exists()
    lr3 = _pair("SAT vs base", "SAT-GRPO · trainer.lr=0.0003", "GRPO · trainer.lr=0.0003", "final")
    lr6 = _pair("SAT vs base", "SAT-GRPO · trainer.lr=0.0006", "GRPO · trainer.lr=0.0006", "final")
    assert f"{float(lr3['mean_diff']):+.2f} points at lr 3e-4 (95 % CI {_ci(lr3)})" in text
    assert f"{float(lr6['mean_diff']):+.2f} points at 6e-4 (95 % CI {_ci(lr6)};" in text


def test_the_lag_cost_at_3e4_is_quoted_from_the_powered_test():
    r = _pair("requested", "GRPO · trainer.lr=0.0003", "GRPO (lag 1) · trainer.lr=0.0003", "final")
    assert float(r["mean_diff"]) < 0 and float(r["p_t"]) < 0.05  # lag 8 does cost GRPO here
    quoted = (
        f"lag 8 − lag 1 = {float(r['mean_diff']):+.2f} points on the final evaluation, "
        f"95 % CI {_ci(r)}, paired t p = {float(r['p_t']):.2g}"
    )
    assert quoted in _text(RESULTS / "README.md")


def test_distinct_dpi_pairs_are_counted_once():
    with open(RESULTS / "paper_table1_cpu" / "regime.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    run = {(r["method"], r["lag"], r["seed"]): r for r in rows}

    def numbers(key):
        return tuple(v for k, v in run[key].items() if k not in ("run", "method"))

    pairs, distinct = 0, set()
    for method, lag, seed in run:
        if not method.startswith("SAT-"):
            continue
        base = re.sub(r" \(anchored[^)]*\)", "", method[len("SAT-") :])
        pairs += 1
        distinct.add((numbers((method, lag, seed)), numbers((base, lag, seed))))
    n = len(distinct)
    assert (pairs, n) == (24, 21)  # three anchored runs at lag 1 are copies of plain SAT's
    text = _text(RESULTS / "README.md")
    assert f"**{n} of {n}** distinct paired comparisons" in text
    assert f"in all {n} distinct pairs ({pairs} rows, {pairs - n} of them repeats)" in text


def test_run_counts_agree_with_the_sweep_files():
    counts = {p.name: len(load_sweep(p).runs) for p in (ROOT / "sweeps").glob("*.yaml")}
    sweeps_md = (ROOT / "docs" / "sweeps.md").read_text(encoding="utf-8")
    table = dict(re.findall(r"^\| `sweeps/([\w.-]+\.yaml)` \| (\d+) \|", sweeps_md, re.M))
    assert len(table) >= 6
    assert {name: int(n) for name, n in table.items()} == {name: counts[name] for name in table}
    grid = counts["paper_table1_cpu.yaml"]
    assert f"({grid} runs; it ran" in _text(ROOT / "docs" / "sweeps.md")
    assert f"The whole grid, {grid} runs, ran" in _text(ROOT / "docs" / "sweeps.md")
    assert f"= {grid} runs" in _text(RESULTS / "README.md")
    assert f"= {grid} runs" in _text(ROOT / "sweeps" / "paper_table1_cpu.yaml")
    assert f"The whole {grid}-run grid ran" in _text(ROOT / "sweeps" / "paper_table1_cpu.yaml")


def test_inert_threshold_is_the_two_sided_one_everywhere():
    high, low = math.log1p(0.2), -math.log1p(-0.2)  # eps_high = eps_low = 0.2
    assert (f"{high:.3f}", f"{low:.3f}") == ("0.182", "0.223")
    regime = _text(ROOT / "sweeps" / "regime_map_cpu.yaml")
    assert "SAT is inert (its gradients are GRPO's) only when q >= max(l_high, l_low) = 0.223" in (
        regime
    )
    assert "when `q ≥ max(ℓ_high, ℓ_low) = 0.223`" in _text(RESULTS / "README.md")
    assert "inert only for q ≥ 0.223" in _text(ROOT / "docs" / "sweeps.md")


def test_sweeps_doc_describes_the_warm_start_the_sweep_code_uses():
    code = (ROOT / "sat_cli" / "sweep" / "jobs.py").read_text(encoding="utf-8")
    assert '"pretrain", "--use-shipped"' in code
    assert "`sat pretrain --use-shipped`" in _text(ROOT / "docs" / "sweeps.md")


def test_the_post_treatment_manipulation_check_is_disclosed():
    for path in (RESULTS / "README.md", RESULTS / "sat_power_cpu.md"):
        text = _text(path)
        # where the check is described, and in the generated verdict that uses it
        assert "not a pre-treatment quantity" in text.split("<!-- generated: power_verdict -->")[0]
        verdict = text.split("<!-- generated: power_verdict -->")[1]
        assert verdict.count("an outcome of SAT, not a pre-treatment quantity") == 2
    assert "not a pre-treatment quantity" in _text(ROOT / "sweeps" / "sat_power_cpu.yaml")
    assert "an outcome of SAT itself" in _text(ROOT / "README.md")


def test_the_gspo_tis_collapse_is_not_attributed_to_the_paper():
    text = _text(RESULTS / "README.md")
    assert "This is **not** a failure the paper reports" in text
    assert "marks only plain GRPO and plain GSPO as collapsing later at lag 8" in text


COLLAPSE_WRITE_UP = [ROOT / "README.md", RESULTS / "README.md", RESULTS / "collapse_cpu.md"]


@pytest.mark.parametrize(
    "phrase",
    [
        "the CPU toy cannot test",  # pilot 1 ruled out its four candidates, not the toy
        "cannot test the collapse claim",
        "not specific to lag",  # lag sped the divergence up (C4: step 100 at lag 1, 10-20 at 8)
        "SAT could not have changed a gradient",
        "are implemented and compose",  # score centering was anti-centred on the default ratio
    ],
)
def test_the_collapse_write_up_claims_only_what_pilot_1_shows(phrase):
    hits = [
        str(p.relative_to(ROOT)) for p in COLLAPSE_WRITE_UP if phrase.lower() in _text(p).lower()
    ]
    assert hits == []


def test_the_collapse_write_up_names_the_phenotype():
    import csv

    rows = list(csv.DictReader((RESULTS / "collapse_cpu" / "pilot.csv").open()))
    fell = [r for r in rows if r["collapsed"] == "1"]
    # every pilot-1 collapse peaked at step 0, most fell by the first evaluation: early divergence
    assert all(r["eval_best"] == r["eval_first"] for r in fell)
    first = sum(r["t_collapse"] == "10" for r in fell)
    assert (len(fell), first) == (11, 8)
    for path in COLLAPSE_WRITE_UP:
        text = _text(path)
        assert "early divergence" in text and "late collapse" in text, path
    assert f"{first} of {len(fell)} below half of it by step 10" in _text(ROOT / "README.md")
    assert (
        f"All {len(fell)} runs\n  counted as collapsed" in (RESULTS / "collapse_cpu.md").read_text()
    )
