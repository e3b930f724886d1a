"""Prompt templates: one place that turns a problem statement into the text the model sees.

Every task (the toy task, AIME, MATH-500, GSM8K, DAPO-Math) renders its prompts here, so the
template is a config value (`task.template` / `eval.template`) and never hard-coded in a loader.
"""

from __future__ import annotations

TEMPLATES: dict[str, str] = {
    # The toy task on the char-level tiny model: the bare problem, e.g. "123+456=".
    "plain": "{problem}",
    # Base models (the paper's Qwen3-30B-A3B-Base): ask for the final answer in \boxed{}.
    "boxed": "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
    # DAPO-Math-17k's own instruction, answered on an "Answer:" line.
    "dapo": (
        "Solve the following math problem step by step. The last line of your response should be "
        "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
        '\n\n{problem}\n\nRemember to put your answer on its own line after "Answer:".'
    ),
}


def render(template: str, problem: str) -> str:
    """Render ``problem`` with a named template, or with a literal template holding ``{problem}``."""
    if template in TEMPLATES:
        return TEMPLATES[template].format(problem=problem)
    if "{problem}" in template:
        return template.replace("{problem}", problem)
    raise ValueError(
        f"unknown prompt template {template!r}: use one of {sorted(TEMPLATES)} "
        "or a literal string containing '{problem}'"
    )
