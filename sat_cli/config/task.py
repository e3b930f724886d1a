"""The ``task`` section of the schema: the toy generator or a data task (a user's file, GSM8K,
DAPO-Math) with its field mapping and held-out split (:mod:`sat_cli.tasks.sources`,
:mod:`sat_cli.tasks.dataset`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sat_cli.validate import ConfigError, check_choice, check_range


@dataclass
class FieldsConfig:
    """Columns of a user's data file (``task.path``): null = the known layouts (``{id, problem,
    answer}``, GSM8K, AIME/MATH-500, DAPO-Math). With ``prompt`` and ``answer`` set, every other
    column is passed to the reward as part of the row."""

    prompt: str | None = None  # the column holding the problem statement
    answer: str | None = None  # the column holding the reference answer
    system: str | None = None  # optional column: a per-row system prompt (task.template=chat)
    id: str | None = None  # optional column: the row id (default: the file's name and row number)

    def __post_init__(self) -> None:
        if (self.prompt is None) != (self.answer is None):
            raise ConfigError(
                "task.fields.prompt and task.fields.answer are set together (the columns of the "
                "problem and of its reference answer), or neither (the known layouts)"
            )
        for key in ("prompt", "answer", "system", "id"):
            value = getattr(self, key)
            if value is not None and not value.strip():
                raise ConfigError(f"task.fields.{key} is empty: name a column of the data file")
        seen: dict[str, str] = {}  # one column, one role (issue 53: settings that contradict)
        for key in ("prompt", "answer", "system", "id"):
            value = getattr(self, key)
            if value is not None and value in seen:
                raise ConfigError(
                    f"task.fields.{key} and task.fields.{seen[value]} name the same column "
                    f"{value!r}: each role (prompt, answer, system, id) needs its own column"
                )
            if value is not None:
                seen[value] = key


@dataclass
class TaskConfig:
    name: str = "toy_add"
    kind: str = "toy"  # toy | file (task.path) | jsonl (= file) | dapo_math | gsm8k
    # the training prompts: a .jsonl or .parquet file or a Hugging Face `datasets` folder written
    # by save_to_disk (local only); with kind=toy it makes the task kind=file
    path: str | None = None
    fields: FieldsConfig = field(default_factory=FieldsConfig)
    digits: int = 3  # toy difficulty: digits per operand
    template: str = (
        "plain"  # prompt template (sat_cli/tasks/prompts.py) or a literal with {problem}
    )
    prompts_per_step: int = 32
    samples_per_prompt: int = 8  # group size G
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    heldout_size: int = 256
    # data tasks with eval=heldout (their default): this fraction of the rows (chosen by a hash
    # of the problem text, at least one) is held out of training and evaluated, unless
    # heldout_path names a file of held-out rows (same format and fields)
    heldout_frac: float = 0.1
    heldout_path: str | None = None
    # template=chat: the system message (a row's task.fields.system column wins)
    system_prompt: str | None = None

    def __post_init__(self) -> None:
        from sat_cli.tasks.registry import TASK_SOURCES

        check_choice("task.kind", self.kind, tuple(TASK_SOURCES.names()))
        if self.path is not None and TASK_SOURCES.get(self.kind).with_path:
            self.kind = TASK_SOURCES.get(self.kind).with_path  # toy + a user's file: kind=file
        source = TASK_SOURCES.get(self.kind)
        check_range("task.digits", self.digits, 1, 9)
        check_range("task.prompts_per_step", self.prompts_per_step, 1)
        check_range("task.samples_per_prompt", self.samples_per_prompt, 1)
        check_sampling("task", self)
        check_range("task.heldout_size", self.heldout_size, 1)
        check_range("task.heldout_frac", self.heldout_frac, 0, 1, lo_open=True, hi_open=True)
        for key in ("path", "heldout_path"):
            if getattr(self, key) is not None and not getattr(self, key).strip():
                raise ConfigError(f"task.{key} is empty: give a file or folder, or leave it unset")
        if source.needs_path and not self.path:
            raise ConfigError(
                f"task.kind={self.kind} needs task.path=<file.jsonl | file.parquet | datasets "
                "folder> (the training prompts)"
            )
        if not source.data and self.template == "chat":
            raise ConfigError(
                "task.template=chat is for data tasks (task.path=…); the toy task's char-level "
                "model has no chat template"
            )
        if self.system_prompt is not None and self.template != "chat":
            raise ConfigError(
                "task.system_prompt is the system message of task.template=chat; with "
                f"task.template={self.template!r} it would be ignored"
            )
        if self.heldout_path is not None and not source.data:
            raise ConfigError("task.heldout_path is for data tasks; the toy task holds out its own")
        if self.fields.system is not None and self.template != "chat":
            raise ConfigError(
                "task.fields.system is the per-row system message of task.template=chat; with "
                f"task.template={self.template!r} it would be ignored"
            )
        if self.path and self.heldout_path and _same_file(self.path, self.heldout_path):
            raise ConfigError(
                f"task.heldout_path and task.path are the same data ({self.heldout_path}): "
                "every held-out problem would also be trained on; give a file of other rows, "
                "or leave task.heldout_path unset (a held-out split of task.path)"
            )

    @property
    def is_data(self) -> bool:
        """A task over a fixed set of rows (not the toy generator)."""
        from sat_cli.tasks.registry import TASK_SOURCES

        return TASK_SOURCES.get(self.kind).data


def _same_file(a: str, b: str) -> bool:
    """Whether two data paths name the same file or folder (links and ``..`` resolved)."""
    import os

    try:
        return os.path.samefile(a, b)
    except OSError:  # one does not exist (refused later, naming it): compare the text
        return os.path.realpath(a) == os.path.realpath(b)


def check_sampling(section: str, s) -> None:
    """One rule for the sampling settings of the training rollouts (``task``) and of the
    evaluation (``eval``): ``eval.top_k=0`` was taken while ``task.top_k=0`` was refused."""
    check_range(f"{section}.max_new_tokens", s.max_new_tokens, 1)
    check_range(f"{section}.temperature", s.temperature, 0, lo_open=True)
    check_range(f"{section}.top_p", s.top_p, 0, 1, lo_open=True)
    if s.top_k != -1 and s.top_k < 1:
        raise ConfigError(f"{section}.top_k must be -1 (off) or >= 1")
    check_template(f"{section}.template", s.template)


def check_template(key: str, value: str) -> None:
    from sat_cli.tasks.prompts import CHAT, TEMPLATES

    if value not in TEMPLATES and value != CHAT and "{problem}" not in value:
        names = ", ".join(sorted([*TEMPLATES, CHAT]))
        raise ConfigError(
            f"{key}={value!r} is neither a template name ({names}) nor a "
            "literal holding {problem}"
        )
