"""Checks made before a command writes anything or starts a process (all raise ``UserError``).

* ``check_output_dir(path, what)`` (in ``sat_cli.util.fsio``) — a folder the command will
  create or write into: every existing part of the path is a folder, each name fits the file
  system (``NAME_MAX``), the whole path fits ``PATH_MAX``, and the nearest existing folder is
  writable (``os.access``, which also sees read-only mounts).
* ``load_tokenizer(path)`` — the model's tokenizer loads (missing or truncated tokenizer files
  are named up front rather than after the engine and trainer started).
* ``check_prompt_lengths`` — **bounded prompts**. A prompt is *too long* when it fills the
  model's context (``max_position_embeddings`` of its ``config.json``) so that not one token can
  be generated: ``prompt tokens >= context``. (The generation budget is not counted: models
  without a hard position limit, like the tiny model, sample past it, and a server enforces its
  own limit on prompt + ``max_new_tokens``.) Training prompts that are too long are
  dropped from the prompt set before the run starts and counted (printed, and the MLflow tag
  ``data.overlong_dropped``); if none is left the run is refused. Evaluation problems that are
  too long stay in the benchmark and are **scored as wrong without sampling** (the model cannot
  answer them; dropping them would make the score not the benchmark's): a warning names the
  count and the first ids, ``summary.json`` and the metric ``eval/<name>/overlong`` count them,
  and their per-problem rows say ``overlong``. If every problem is too long the command is
  refused (exit 2). The toy task's prompts all have one length (one is checked). Without
  ``max_position_embeddings`` nothing is checked.
* ``check_trainer_layout`` / ``check_engine_architecture`` — the chosen trainer and engine can
  build and serve the model (their registry entries' ``check_model``); ``trainer=megatron``
  trains what its worker can build (Qwen3-MoE):
  anything else is refused naming the model, instead of failing inside the worker as "cannot
  load the model". The parallel layout is checked at compose time (``sat_cli.config.layout``).
* ``check_address_space`` — an address-space limit (``ulimit -v``) below what one process of a
  run maps (torch, transformers, MLflow: about 1.5 GiB on the CPU default) ends the run inside
  native code (OpenBLAS: "Memory allocation still failed", exit 1 with no message and the MLflow
  run left RUNNING): refused up front (``RunFailed``, exit 1: a resource limit, not the input).
"""

from __future__ import annotations

from pathlib import Path

from sat_cli.errors import RunFailed, UserError
from sat_cli.models.hf_config import config_if_usable
from sat_cli.util.fsio import check_output_dir

MIN_ADDRESS_SPACE = 2 << 30  # bytes of address space one process of a run needs at least


def check_run_folder(run_dir: Path) -> None:
    """``check_output_dir`` plus the fixed parts of a run folder: ``checkpoints``, ``weights``
    and ``logs`` are folders and ``config.yaml`` is not, where they exist."""
    check_output_dir(run_dir, "run folder")
    for name, want_dir in (("checkpoints", True), ("weights", True), ("logs", True)):
        p = Path(run_dir) / name
        if (p.exists() or p.is_symlink()) and p.is_dir() != want_dir:
            raise UserError(f"run folder {run_dir}: {p} is a file, not a folder")
    if (Path(run_dir) / "config.yaml").is_dir():
        raise UserError(f"run folder {run_dir}: {Path(run_dir) / 'config.yaml'} is a folder")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(path: str):
    """The model's tokenizer, or ``UserError``: a local folder must have tokenizer files
    (without them transformers builds an empty tokenizer of the model type that encodes every
    text to nothing), they must load, the tokenizer must encode text, have an end-of-sequence
    token, and every token id must be a row of the model's embedding (``vocab_size``)."""
    from transformers import AutoTokenizer

    p = Path(path)
    if p.is_dir() and not any((p / f).is_file() for f in _TOKENIZER_FILES):
        raise UserError(
            f"{path} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}): add the "
            "tokenizer the model was trained with"
        )
    try:
        tok = AutoTokenizer.from_pretrained(path)
        sample = tok("1+1=", add_special_tokens=False)["input_ids"]
    except Exception as exc:  # OSError, ValueError, JSONDecodeError, tokenizers' Exception
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise UserError(
            f"cannot load the tokenizer of {path}: {type(exc).__name__}: {first}"
        ) from None
    if not sample:
        raise UserError(f"the tokenizer of {path} encodes text to no tokens: it is empty")
    if tok.eos_token_id is None:
        raise UserError(f"the tokenizer of {path} has no end-of-sequence token (eos_token)")
    vocab = (config_if_usable(p) or {}).get("vocab_size")
    if isinstance(vocab, int) and len(tok) > vocab:
        raise UserError(
            f"the tokenizer of {path} has {len(tok)} tokens but the model's embedding only "
            f"{vocab} rows (config.json vocab_size): they do not belong together"
        )
    if isinstance(vocab, int) and not isinstance(vocab, bool):
        top = _largest_id(tok)
        if top is not None and top[0] >= vocab:
            raise UserError(
                f"the tokenizer of {path} gives {top[1]!r} the id {top[0]}, but the model's "
                f"embedding has only {vocab} rows (config.json vocab_size; ids 0..{vocab - 1}): "
                "they do not belong together"
            )
    return tok


def _largest_id(tok) -> tuple[int, str] | None:
    """``(id, token)`` of the largest id the tokenizer can produce: its vocabulary, added and
    special tokens (ids need not be contiguous, so ``len(tok)`` does not bound them)."""
    try:
        ids = {int(i): str(t) for t, i in tok.get_vocab().items()}
        special = zip(tok.all_special_tokens, tok.all_special_ids, strict=True)
        ids.update({int(i): str(t) for t, i in special})
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary: nothing to compare
        return None
    return max(ids.items()) if ids else None


def context_length(path: str) -> int | None:
    n = (config_if_usable(path) or {}).get("max_position_embeddings")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def _too_long(tokenize, texts: list[str], limit: int, max_token_bytes: int) -> list[int]:
    """Indices of ``texts`` with more than ``limit`` tokens. Only texts in between are
    tokenized: a text of at most ``limit - 8`` UTF-8 bytes fits (no tokenizer in use makes more
    tokens than bytes, plus a few special tokens), and one longer than ``limit`` times the
    longest token of the vocabulary cannot fit — so a 50 MB prompt is not tokenized (that alone
    took gigabytes)."""
    out = []
    for i, text in enumerate(texts):
        n = len(text.encode("utf-8", "surrogatepass"))
        if n + 8 <= limit:
            continue
        if n > limit * max_token_bytes or len(tokenize(text)) > limit:
            out.append(i)
    return out


def _max_token_bytes(tokenizer) -> int:
    """Bytes of the longest vocabulary entry (an upper bound on what one token covers)."""
    try:
        vocab = tokenizer.get_vocab()
        return max(1, max((len(str(t).encode("utf-8", "surrogatepass")) for t in vocab), default=1))
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary: tokenize everything
        return 1 << 30


def _render_all(template: str, rows: list[dict], what: str, tokenizer) -> list[str]:
    from sat_cli.tasks.prompts import render

    try:
        return [render(template, r["problem"], tokenizer, r.get("system")) for r in rows]
    except ValueError as exc:  # an unknown template, or template=chat without a chat template
        raise UserError(f"{what}: {exc}") from None


def check_chat_template(
    templates: dict[str, str], tokenizer, path: str, system: bool = False
) -> None:
    """Refuse ``<key>=chat`` (``templates``: config key -> template) for a tokenizer without a
    chat template, or whose template fails on a sample prompt (:func:`_render_sample`; with a
    system message when ``system``), naming the model folder, before anything starts."""
    from sat_cli.tasks.prompts import CHAT

    for key, template in templates.items():
        if template == CHAT and not getattr(tokenizer, "chat_template", None):
            raise UserError(
                f"{key}=chat renders prompts through the tokenizer's chat template, and the "
                f"tokenizer of {path} has none (no chat_template in tokenizer_config.json or "
                "chat_template.jinja); use a named template (boxed, plain, dapo) or a literal "
                "holding {problem}"
            )
        if template == CHAT:
            _render_sample(key, tokenizer, path, system)


SAMPLE_PROBLEM = "What is 12 + 30?"  # the prompt the chat template is tried on at start
SAMPLE_SYSTEM = "Answer briefly."


def _render_sample(key: str, tokenizer, path: str, system: bool) -> None:
    """The chat template rendered once on :data:`SAMPLE_PROBLEM` (after a system message when
    the task has one): a template that raises, renders nothing or drops the problem is refused
    here, naming the folder, not at the first generate."""
    from sat_cli.tasks.prompts import render_chat

    try:
        text = render_chat(tokenizer, SAMPLE_PROBLEM, SAMPLE_SYSTEM if system else None)
    except Exception as exc:  # noqa: BLE001 - a user's template: any failure is the template's
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise UserError(
            f"{key}=chat: the chat template of {path} fails to render a sample prompt"
            f"{' with a system message' if system else ''} ({type(exc).__name__}: {first})"
        ) from None
    if not isinstance(text, str) or not text.strip():
        raise UserError(f"{key}=chat: the chat template of {path} renders a prompt as empty text")
    if SAMPLE_PROBLEM not in text:
        raise UserError(
            f"{key}=chat: the chat template of {path} renders a prompt without its text "
            f"({SAMPLE_PROBLEM!r} became {text[:120]!r})"
        )


def check_prompt_lengths(task, tokenizer, path: str, log=print) -> int:
    """Drop training prompts that cannot fit (returns how many); see the module docstring."""
    limit = context_length(path)
    if limit is None:
        return 0
    budget = limit - 1  # room for at least one generated token

    def tokenize(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    rows = getattr(task, "rows", None)
    if rows is None:  # the toy task: every prompt has the same length
        prompts = [r["prompt"] for r in task.sample_prompts(1, 0)]
        if _too_long(tokenize, prompts, budget, _max_token_bytes(tokenizer)):
            raise UserError(
                f"task prompts have more than {budget} tokens: they fill the model's context of "
                f"{limit} tokens (see task.template)"
            )
        return 0
    system = getattr(task, "system_prompt", None)
    texts = _render_all(
        task.template, [{"system": system, **r} for r in rows], "task.template", tokenizer
    )
    bad = set(_too_long(tokenize, texts, budget, _max_token_bytes(tokenizer)))
    if not bad:
        return 0
    source = getattr(task, "source", None)
    if source is not None:  # a user's file: every row is meant to be trained on
        first = rows[min(bad)]
        raise UserError(
            f"{source}: row {first['id']!r} (and {len(bad) - 1} more) has a prompt longer than "
            f"{budget} tokens: it fills the model's context of {limit} tokens; shorten or drop "
            "those rows, or use a model with a longer context"
        )
    if len(bad) == len(rows):
        raise UserError(
            f"all {len(rows)} training prompts are longer than {budget} tokens: they fill the "
            f"model's context of {limit} tokens"
        )
    task.rows = [r for i, r in enumerate(rows) if i not in bad]
    log(
        f"dropped {len(bad)} of {len(rows)} training prompts longer than {budget} tokens "
        f"(the model's context is {limit})"
    )
    return len(bad)


def check_token_budget(task, tokenizer, budget: int | None, max_new_tokens: int) -> None:
    """**Token budgets** (``trainer.max_tokens_per_row``, ``trainer.max_tokens_per_micro_batch``;
    ``budget`` the smaller): the longest training prompt plus ``max_new_tokens`` must fit, or
    ``UserError`` naming how many prompts do not (compose time checked one prompt token)."""
    if budget is None:
        return
    room = budget - max_new_tokens  # prompt tokens a sample may have

    def tokenize(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    rows = getattr(task, "rows", None)
    if rows is None:  # the toy task: every prompt has the same length
        texts = [r["prompt"] for r in task.sample_prompts(1, 0)]
    else:
        texts = _render_all(task.template, [r["problem"] for r in rows], "task.template")
    bad = _too_long(tokenize, texts, room, _max_token_bytes(tokenizer))
    if bad:
        raise UserError(
            f"{len(bad)} of {len(texts)} training prompts have more than {room} tokens: with "
            f"task.max_new_tokens={max_new_tokens} their samples are longer than the trainer's "
            f"token budget of {budget} (trainer.max_tokens_per_row / max_tokens_per_micro_batch)"
        )


def check_env_context(env, path: str, budget: int | None = None) -> None:
    """**Bounded trajectories** (``env=<name>``): a trajectory (prompt, turns and observations)
    never grows past ``env.max_tokens`` (the driver ends it ``length`` first), so that bound
    must fit the model's context (``max_position_embeddings``) and the trainer's token budget
    (``budget``), or ``UserError``: the run is refused before anything starts."""
    if env is None or env.name == "none":
        return
    limit = context_length(path)
    n = env.max_tokens
    if limit is not None and n > limit:
        raise UserError(
            f"env.max_tokens={n} is over the model's context of {limit} tokens: a trajectory "
            f"(prompt, turns and observations) could grow past the model's positions; set "
            f"env.max_tokens={limit} or lower"
        )
    if budget is not None and n > budget:
        raise UserError(
            f"env.max_tokens={n} is over the trainer's token budget of {budget} "
            "(trainer.max_tokens_per_row / max_tokens_per_micro_batch): a trajectory could not "
            f"be trained; set env.max_tokens={budget} or lower"
        )


def check_eval_lengths(problems, template: str, tokenizer, path: str, log=print) -> frozenset:
    """Indices of the evaluation problems too long for the model's context (see the module
    docstring: they are scored as wrong, not generated); refuses when every problem is."""
    limit = context_length(path)
    if limit is None or not problems:
        return frozenset()
    texts = _render_all(template, problems, "eval.template", tokenizer)
    bad = _too_long(lambda t: tokenizer.encode(t), texts, limit - 1, _max_token_bytes(tokenizer))
    if not bad:
        return frozenset()
    ids = ", ".join(repr(problems[i]["id"]) for i in bad[:3]) + (" …" if len(bad) > 3 else "")
    what = (
        f"{len(bad)} of {len(problems)} evaluation problems ({ids}) are longer than {limit - 1} "
        f"tokens: they fill the model's context of {limit} tokens"
    )
    if len(bad) == len(problems):
        raise UserError(f"{what}; there is nothing the model can answer")
    log(f"warning: {what}; they are scored as wrong without sampling (counted as 'overlong')")
    return frozenset(bad)


def check_task_inputs(obj, task, tokenizer, path: str) -> None:
    """What a task brings, checked before anything starts: ``template=chat`` needs a chat
    template (a data task then renders through ``tokenizer``), ``engine=sglang`` must serve the
    model's architecture, ``reward=python``'s function must load (in one worker process)."""
    from sat_cli.rewards import check_reward

    templates = {"task.template": obj.task.template, "eval.template": obj.eval.template}
    fields = getattr(obj.task, "fields", None)
    system = bool(getattr(obj.task, "system_prompt", None) or getattr(fields, "system", None))
    check_chat_template(templates, tokenizer, path, system)
    if hasattr(task, "tokenizer"):  # a data task: template=chat renders through it
        task.tokenizer = tokenizer
    check_engine_architecture(obj.engine, path)
    check_reward(obj.reward)


def check_engine_architecture(e, path: str) -> None:
    """The chosen engine (``e``: its settings) serves the architecture of the model folder at
    ``path``: its registry entry's ``check_model`` (``engine=sglang`` launched here:
    ``sat_cli.engines.sglang.models``); refused naming it."""
    from sat_cli.engines.registry import ENGINES

    ENGINES.get(e.name).check_model(e, path)


def check_trainer_layout(t, path: str) -> None:
    """The chosen trainer (``t``: its settings) can build the model at ``path``: its registry
    entry's ``check_model`` (``trainer=megatron``: what its worker builds; the parallel layout
    itself is checked at compose time: ``sat_cli.config.layout``)."""
    from sat_cli.trainers.registry import TRAINERS

    TRAINERS.get(t.name).check_model(t, path)


def check_address_space(command: str) -> None:
    """Refuse to start under an address-space limit below :data:`MIN_ADDRESS_SPACE`."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft >= MIN_ADDRESS_SPACE:
        return
    raise RunFailed(
        f"the address-space limit of this process is {soft / 2**30:.2f} GiB (ulimit -v "
        f"{soft // 1024}); `sat {command}` needs at least {MIN_ADDRESS_SPACE / 2**30:.0f} GiB in "
        "each of its processes (torch, the engine): raise it (ulimit -v unlimited) and run the "
        "command again"
    )
