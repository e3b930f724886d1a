"""Prompt templates: one place that turns a problem statement into the text the model sees.

Every task (the toy task, AIME, MATH-500, GSM8K, DAPO-Math) renders its prompts here, so the
template is a config value (`task.template` / `eval.template`) and never hard-coded in a loader.

``chat`` renders through the model tokenizer's own chat template (``apply_chat_template`` with a
user message, after a system message when the row or ``task.system_prompt`` has one, and the
generation prompt); a tokenizer without a chat template is refused (:class:`ChatTemplateMissing`).
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


CHAT = "chat"  # the tokenizer's own chat template


class ChatTemplateMissing(ValueError):
    """``template=chat`` with a tokenizer that has no chat template."""


def render_chat(tokenizer, problem: str, system: str | None = None) -> str:
    """``problem`` as a user turn (after ``system``) through ``tokenizer``'s chat template."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateMissing(
            "template=chat renders prompts through the tokenizer's chat template, and this "
            "model's tokenizer has none (no chat_template in tokenizer_config.json or "
            "chat_template.jinja); use a named template (boxed, plain, dapo) or a literal "
            "holding {problem}"
        )
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": problem})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def render(template: str, problem: str, tokenizer=None, system: str | None = None) -> str:
    """Render ``problem`` with a named template, the tokenizer's chat template (``chat``; with
    ``system``), or a literal template holding ``{problem}``."""
    if template == CHAT:
        return render_chat(tokenizer, problem, system)
    if template in TEMPLATES:
        return TEMPLATES[template].format(problem=problem)
    if "{problem}" in template:
        return template.replace("{problem}", problem)
    raise ValueError(
        f"unknown prompt template {template!r}: use one of {sorted([*TEMPLATES, CHAT])} "
        "or a literal string containing '{problem}'"
    )
