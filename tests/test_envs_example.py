"""docs/environments.md's worked example ("Writing your own environment") runs as written, and
the environment it registers plays a real trajectory through the driver's renderer."""

from __future__ import annotations

import re
from pathlib import Path

from sat_cli.envs.registry import ENVIRONMENTS

DOC = Path(__file__).resolve().parents[1] / "docs" / "environments.md"


def example_code() -> str:
    section = DOC.read_text().split("### Writing your own environment", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_the_worked_example_runs_as_written():
    namespace: dict = {}
    try:
        exec(compile(example_code(), str(DOC), "exec"), namespace)  # its asserts check values
        env = namespace["make"]("retry", namespace["EnvSettings"](max_turns=3))
        env.reset({"prompt": "1+1=", "answer": "2"})
        steps = [env.step(t) for t in ("\\boxed{3}", "no box", "\\boxed{2}")]
        assert [(s.reward, s.done, s.info["turn"]) for s in steps] == [
            (0.0, False, 1),
            (0.0, False, 2),
            (1.0, True, 3),
        ]
    finally:
        ENVIRONMENTS.remove("retry")
    assert "retry" not in ENVIRONMENTS
