"""avg@k / pass@k against hand-computed values and exact binomials, and the evaluate() driver on a
deterministic test double of the engine (fixed responses), checking its arithmetic, batching,
partial results, output files and metric names."""

from __future__ import annotations

import csv
import json
import math
from concurrent.futures import Future
from fractions import Fraction

import pytest

from sat_cli.engines.base import EngineError, RolloutEngine, Sample, SamplingParams
from sat_cli.evaluation import (
    avg_at_k,
    evaluate,
    format_table,
    metrics,
    pass_at_k,
    pass_at_k_table,
    write_results,
)
from sat_cli.tasks.prompts import render

T, F = True, False

# --------------------------------------------------------------------------------------------
# Estimators
# --------------------------------------------------------------------------------------------


def test_avg_at_k_hand_case() -> None:
    # problem 1: 1 of 4 correct -> 0.25; problem 2: 2 of 4 -> 0.5; mean 0.375 -> 37.5 %
    assert avg_at_k([[T, F, F, F], [T, T, F, F]]) == pytest.approx(37.5)
    # unequal sample counts average per problem first: (1/2 + 2/3) / 2 = 7/12
    assert avg_at_k([[T, F], [T, T, F]]) == pytest.approx(100 * 7 / 12)
    assert avg_at_k([[T] * 8]) == 100.0 and avg_at_k([[F] * 8]) == 0.0
    with pytest.raises(ValueError, match="no problems"):
        avg_at_k([])
    with pytest.raises(ValueError, match="problem 1 has no samples"):
        avg_at_k([[T], []])


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (10, 3, 1, 0.3),  # pass@1 = c/n
        (4, 1, 2, 1 - 3 / 6),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (8, 0, 1, 0.0),  # c = 0: never
        (8, 0, 8, 0.0),
        (8, 8, 1, 1.0),  # c = n: always
        (8, 8, 8, 1.0),
        (8, 5, 4, 1.0),  # n - c = 3 < k = 4: every 4-subset holds a correct sample
        (16, 1, 16, 1.0),
    ],
)
def test_pass_at_k_hand_cases(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-15)


def test_pass_at_k_matches_exact_binomials() -> None:
    for n in range(1, 21):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
                assert pass_at_k(n, c, k) == pytest.approx(float(exact), abs=1e-12), (n, c, k)
    # large n: the product form stays accurate where C(n, k) has hundreds of digits
    exact = 1 - Fraction(math.comb(500, 100), math.comb(1000, 100))
    assert pass_at_k(1000, 500, 100) == pytest.approx(float(exact), rel=1e-12)


def test_pass_at_k_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 0)


def test_pass_at_k_table_hand_case() -> None:
    # p1: c=2 of n=4, p2: c=3, p3: c=0
    # pass@1 = (2/4 + 3/4 + 0)/3            = 41.666…%
    # pass@2 = ((1 - 1/6) + 1 + 0)/3         (p1: 1 - C(2,2)/C(4,2) = 5/6; p2: n-c=1 < 2) = 61.11%
    # pass@3 = (1 + 1 + 0)/3 = 66.67%,  pass@4 = 66.67%
    correct = [[T, F, T, F], [T, T, T, F], [F, F, F, F]]
    table = pass_at_k_table(correct)
    assert list(table) == [1, 2, 3, 4]
    assert table[1] == pytest.approx(100 * 5 / 12)
    assert table[2] == pytest.approx(100 * (5 / 6 + 1) / 3)
    assert table[3] == pytest.approx(100 * 2 / 3)
    assert table[4] == pytest.approx(100 * 2 / 3)
    assert table[1] == pytest.approx(avg_at_k(correct))  # pass@1 == avg@n


# --------------------------------------------------------------------------------------------
# A deterministic test double of the engine (fixed responses) and a byte tokenizer
# --------------------------------------------------------------------------------------------

EOS = 256


class ByteTokenizer:
    """UTF-8 bytes as ids, plus one special EOS id that decode drops."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if not skip_special_tokens and EOS in ids:
            raise AssertionError("evaluate() must decode with skip_special_tokens=True")
        return bytes(i for i in ids if i != EOS).decode("utf-8")


class FixedResponseEngine(RolloutEngine):
    """Returns, for each prompt, the first ``n`` of a fixed list of responses for that prompt
    (a RolloutEngine subclass, so the protocol's optional members keep their defaults)."""

    def __init__(
        self, responses: dict[str, list[str]], tokenizer: ByteTokenizer, *, fail_on_call=None
    ):
        self.responses = responses
        self.tok = tokenizer
        self.calls: list[list[list[int]]] = []
        self.fail_on_call = fail_on_call
        self.abort: set[str] = set()

    def generate(self, prompts, n, sampling):
        self.calls.append(prompts)
        if self.fail_on_call == len(self.calls):
            raise EngineError("server died")
        out = []
        for ids in prompts:
            text = self.tok.decode(ids)
            group = []
            for j, resp in enumerate(self.responses[text][:n]):
                rid = self.tok.encode(resp) + [EOS]
                reason = "abort" if (text in self.abort and j == 0) else "stop"
                group.append(Sample(ids, rid, [-0.5] * len(rid), reason, weight_version=0))
            out.append(group)
        return out

    def generate_async(self, prompts, n, sampling):
        fut: Future = Future()
        fut.set_result(self.generate(prompts, n, sampling))
        return fut

    def update_weights(self, path, version):
        pass

    def health(self):
        return True

    def close(self):
        pass


TEMPLATE = "boxed"
PROBLEMS = [
    {"id": "p1", "problem": "What is 2+3?", "answer": "5"},
    {"id": "p2", "problem": "Half of one?", "answer": "\\frac{1}{2}"},
    {"id": "p3", "problem": "What is 3+4?", "answer": "7"},
]
RESPONSES = {
    # correct: T F T F -> c = 2
    "What is 2+3?": ["so \\boxed{5}", "\\boxed{6}", "Answer: 5", "no idea"],
    # correct: T T T F -> c = 3 (0.5, 1/2 and \dfrac{1}{2} all equal \frac{1}{2})
    "Half of one?": ["\\boxed{0.5}", "\\boxed{1/2}", "\\boxed{\\dfrac{1}{2}}", "\\boxed{2}"],
    # correct: F F F F -> c = 0 ("77" contains the gold "7"; "\\boxed{7" is unterminated)
    "What is 3+4?": ["\\boxed{8}", "\\boxed{77}", "Answer: 6", "\\boxed{7"],
}


def _engine(**kw) -> tuple[FixedResponseEngine, ByteTokenizer]:
    tok = ByteTokenizer()
    rendered = {render(TEMPLATE, p): r for p, r in RESPONSES.items()}
    return FixedResponseEngine(rendered, tok, **kw), tok


def test_evaluate_arithmetic_and_rows() -> None:
    engine, tok = _engine()
    assert isinstance(engine, RolloutEngine)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=32)
    res = evaluate(
        engine, tok, PROBLEMS, n=4, sampling=sampling, template=TEMPLATE, batch_size=2, name="toy"
    )
    # batching: 2 prompts, then 1; prompts are the rendered, encoded problems
    assert [len(c) for c in engine.calls] == [2, 1]
    assert engine.calls[0][0] == tok.encode(render(TEMPLATE, "What is 2+3?"))
    assert res.complete and res.error is None
    assert res.num_problems == res.num_finished == 3
    assert [r.correct for r in res.rows] == [2, 3, 0]
    assert res.rows[0].flags == [T, F, T, F]
    assert res.rows[0].answers == ["5", "6", "5", None]
    assert res.rows[2].answers == ["8", "77", "6", None]
    assert res.rows[1].gold == "\\frac{1}{2}" and res.rows[1].id == "p2"
    assert res.rows[0].response_tokens == [len("so \\boxed{5}") + 1, 10, 10, 8]
    # avg@4 = (2/4 + 3/4 + 0/4)/3 = 41.67 %, pass@2 = (5/6 + 1 + 0)/3 = 61.11 %
    assert res.avg_at_k == pytest.approx(100 * 5 / 12)
    assert res.pass_at_k[2] == pytest.approx(100 * (5 / 6 + 1) / 3)
    assert res.pass_at_k[4] == pytest.approx(100 * 2 / 3)
    assert res.wall_s > 0 and res.problems_per_s == pytest.approx(3 / res.wall_s)

    m = metrics(res)
    assert m == {
        "eval/toy/avg@4": res.avg_at_k,
        "eval/toy/pass@1": res.pass_at_k[1],
        "eval/toy/pass@2": res.pass_at_k[2],
        "eval/toy/pass@3": res.pass_at_k[3],
        "eval/toy/pass@4": res.pass_at_k[4],
        "eval/toy/reward_error_frac": 0.0,  # the task's grader never fails
    }
    assert set(metrics(res, final=True)) == {
        "final/toy/reward_error_frac",
        "final/toy/avg@4",
        "final/toy/pass@1",
        "final/toy/pass@2",
        "final/toy/pass@3",
        "final/toy/pass@4",
    }

    table = format_table(res)
    assert "avg@4" in table and "41.67" in table and "3/3" in table and "complete" in table


def test_overlong_problems_are_scored_wrong_without_sampling() -> None:
    """Problems whose prompt does not fit the context stay in the benchmark as n wrong samples;
    only the others reach the engine, in order, and the count is a metric."""
    engine, tok = _engine()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=32)
    res = evaluate(
        engine,
        tok,
        PROBLEMS,
        n=4,
        sampling=sampling,
        template=TEMPLATE,
        batch_size=2,
        name="toy",
        overlong=frozenset({1}),
    )
    # batch 1 sends p1 only (p2 is overlong), batch 2 sends p3
    assert [len(c) for c in engine.calls] == [1, 1]
    assert engine.calls[0][0] == tok.encode(render(TEMPLATE, "What is 2+3?"))
    assert res.complete and [r.id for r in res.rows] == ["p1", "p2", "p3"]
    assert [r.correct for r in res.rows] == [2, 0, 0]
    assert res.rows[1].finish_reasons == ["overlong"] * 4 and res.rows[1].response_tokens == [0] * 4
    # avg@4 over all three problems = (2/4 + 0 + 0)/3
    assert res.avg_at_k == pytest.approx(100 * 2 / 12)
    assert metrics(res)["eval/toy/overlong"] == 1.0
    assert res.summary()["meta"]["overlong"] == 1
    # every problem overlong: nothing reaches the engine
    engine2, _ = _engine()
    res2 = evaluate(
        engine2,
        tok,
        PROBLEMS,
        n=2,
        sampling=sampling,
        template=TEMPLATE,
        overlong=frozenset({0, 1, 2}),
    )
    assert engine2.calls == [] and res2.avg_at_k == 0.0 and res2.complete


def test_custom_grader_is_used() -> None:
    engine, tok = _engine()
    # a grader that only accepts the literal string "\boxed{6}"
    res = evaluate(
        engine,
        tok,
        PROBLEMS,
        n=4,
        sampling=SamplingParams(),
        template=TEMPLATE,
        grader=lambda resp, gold: resp == "\\boxed{6}",
    )
    assert [r.correct for r in res.rows] == [1, 0, 0]
    assert res.avg_at_k == pytest.approx(100 * (1 / 4) / 3)


def test_engine_failure_gives_incomplete_result() -> None:
    engine, tok = _engine(fail_on_call=2)
    res = evaluate(
        engine, tok, PROBLEMS, n=4, sampling=SamplingParams(), template=TEMPLATE, batch_size=2
    )
    assert not res.complete
    assert "EngineError: server died" in res.error
    assert [r.id for r in res.rows] == ["p1", "p2"] and res.num_problems == 3
    assert res.avg_at_k == pytest.approx(100 * (2 / 4 + 3 / 4) / 2)  # over finished problems only
    assert "INCOMPLETE" in format_table(res)


def test_an_interrupt_is_kept_to_be_raised_again() -> None:
    """Ctrl-C (or SIGTERM/SIGHUP as a KeyboardInterrupt subclass) mid-way: the finished
    problems are kept and the very exception travels in the result, not only as text."""
    engine, tok = _engine()
    stop = KeyboardInterrupt()
    generate = engine.generate

    def interrupted(prompts, n, sampling):
        if len(engine.calls) == 1:
            raise stop
        return generate(prompts, n, sampling)

    engine.generate = interrupted
    res = evaluate(
        engine, tok, PROBLEMS, n=4, sampling=SamplingParams(), template=TEMPLATE, batch_size=2
    )
    assert not res.complete and res.interrupted is stop
    assert [r.id for r in res.rows] == ["p1", "p2"]
    engine, tok = _engine(fail_on_call=2)
    res = evaluate(
        engine, tok, PROBLEMS, n=4, sampling=SamplingParams(), template=TEMPLATE, batch_size=2
    )
    assert not res.complete and res.interrupted is None


def test_aborted_or_short_groups_are_not_complete(tmp_path) -> None:
    engine, tok = _engine()
    engine.abort.add(render(TEMPLATE, "Half of one?"))
    res = evaluate(engine, tok, PROBLEMS, n=4, sampling=SamplingParams(), template=TEMPLATE)
    assert not res.complete and "p2" in res.error and "abort" in res.error
    assert [r.id for r in res.rows] == ["p1", "p3"]
    # asking for more samples than the engine returns is also incomplete
    engine2, tok2 = _engine()
    res2 = evaluate(engine2, tok2, PROBLEMS, n=5, sampling=SamplingParams(), template=TEMPLATE)
    assert not res2.complete and res2.rows == []
    assert math.isnan(res2.avg_at_k) and res2.pass_at_k == {}
    summary = json.loads(write_results(res2, tmp_path)["summary"].read_text("utf-8"))
    assert summary["avg@5"] is None and summary["complete"] is False


def test_write_results_atomic_files(tmp_path) -> None:
    engine, tok = _engine()
    res = evaluate(
        engine, tok, PROBLEMS, n=4, sampling=SamplingParams(), template=TEMPLATE, name="toy"
    )
    out = tmp_path / "eval" / "toy"
    paths = write_results(res, out)
    assert sorted(p.name for p in out.iterdir()) == [
        "per_problem.csv",
        "per_problem.json",
        "summary.json",
    ]  # no temp files left behind
    rows = json.loads(paths["per_problem_json"].read_text("utf-8"))
    assert [(r["id"], r["correct"], r["n"], r["gold"]) for r in rows] == [
        ("p1", 2, 4, "5"),
        ("p2", 3, 4, "\\frac{1}{2}"),
        ("p3", 0, 4, "7"),
    ]
    assert rows[0]["answers"] == ["5", "6", "5", None]
    with paths["per_problem_csv"].open(newline="", encoding="utf-8") as fh:
        csv_rows = list(csv.DictReader(fh))
    assert [(r["id"], r["correct"], r["accuracy"]) for r in csv_rows] == [
        ("p1", "2", "0.500000"),
        ("p2", "3", "0.750000"),
        ("p3", "0", "0.000000"),
    ]
    assert json.loads(csv_rows[1]["answers"]) == ["0.5", "1/2", "\\dfrac{1}{2}", "2"]
    summary = json.loads(paths["summary"].read_text("utf-8"))
    assert summary["complete"] is True and summary["n"] == 4
    assert summary["avg@4"] == pytest.approx(100 * 5 / 12)
    assert summary["pass@k"]["2"] == pytest.approx(100 * (5 / 6 + 1) / 3)
    assert summary["num_correct_samples"] == 5
    # rewriting replaces the files in place
    write_results(res, out)
    assert len(list(out.iterdir())) == 3


def test_eval_folder_is_created_exclusively(tmp_path):
    """Two `sat eval` started in the same second get two folders (found by the hostile pass:
    the folder name has one-second resolution, and both wrote into it)."""
    from sat_cli.commands.eval import _own_folder

    base = tmp_path / "eval" / "toy-20260101-000000"
    got = [_own_folder(base) for _ in range(3)]
    assert [p.name for p in got] == [base.name, base.name + "-2", base.name + "-3"]
    assert all(p.is_dir() for p in got)


FAILING_REWARD = """
def score(prompt, response, row):
    if "boxed" not in response:
        raise ValueError("no box in " + response)
    return 1.0 if "{" + row["answer"] + "}" in response else 0.0
"""


def test_reward_errors_of_an_evaluation_are_logged_and_refused_above_the_limit(tmp_path):
    """A reward plugin (real worker processes) that raises on the responses without a box:
    those samples count as wrong in avg@k, and the evaluation reports their fraction
    (``eval/<bench>/reward_error_frac``); above ``reward.max_error_frac`` it is refused."""
    from types import SimpleNamespace

    from test_rewards import settings as reward_settings

    from sat_cli.evaluation.output import check_reward_errors
    from sat_cli.rewards import RewardFailed
    from sat_cli.rewards.grading import PassGrader

    fn = tmp_path / "reward.py"
    fn.write_text(FAILING_REWARD)
    reward = reward_settings(name="python", fn=f"{fn}:score", on_error=0.0, workers=1)
    settings = SimpleNamespace(**vars(reward), pass_threshold=1.0)
    grader = PassGrader(settings, SimpleNamespace(scorer=None))
    engine, tok = _engine()
    try:
        res = evaluate(
            engine,
            tok,
            PROBLEMS,
            n=4,
            sampling=SamplingParams(),
            template=TEMPLATE,
            grader=grader,
            name="toy",
        )
    finally:
        grader.close()
    # without a box: "Answer: 5", "no idea" (p1), "Answer: 6" (p3): 3 of 12 samples failed
    assert (res.meta["reward_errors"], res.meta["graded"]) == (3, 12)
    assert res.reward_error_frac == 0.25
    assert metrics(res)["eval/toy/reward_error_frac"] == 0.25
    assert "no box in Answer: 5" in res.meta["reward_error"]
    # correct with the box only: p1 1 (\boxed{5}), p2 0 (the gold is \frac{1}{2}), p3 0
    assert [r.correct for r in res.rows] == [1, 0, 0]
    check_reward_errors(res, 0.25)  # at the limit: allowed
    with pytest.raises(
        RewardFailed,
        match=r"evaluation toy: 3 of 12 rewards failed \(25.0% > "
        r"reward.max_error_frac=0.2\), so its avg@4 8.3 counts them as wrong",
    ):
        check_reward_errors(res, 0.2)
