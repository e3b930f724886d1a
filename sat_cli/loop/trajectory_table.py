"""The samples table of a multi-turn batch (``env=<name>``; docs/environments.md): one row per
turn of each trajectory, written as ``samples/train_step_<N>.json`` every
``tracking.samples_every`` steps, in place of the single-turn table.

Columns: ``id`` (the task row), ``sample`` (the trajectory's index in the batch, group-major),
``turn`` (from 0), ``input`` (what the model read before the turn: the prompt at turn 0, then
the previous turn's observation, decoded as the engine got it), ``response`` (the turn's model
tokens, decoded without special tokens, as the environment got them), ``versions`` (the weight
version of each of the turn's model tokens), ``tool_calls`` (the calls the run's tool-call parser
reads in the response: ``{"name", "arguments"}``), ``tool_errors`` (its malformed-call lines),
``tool_results`` (the contents of the environment's ``tool`` messages answering the turn),
``reward`` (the environment's reward of the turn), ``trajectory_reward`` (the sample's reward:
what the trainer got, None for a dropped group) and ``finish`` (the trajectory's finish reason).

Everything but ``tool_results`` and ``reward`` comes from the sample's tokens, so a replayed
batch (its samples keep no ``meta``) has the same table with those two None. At most
``MAX_TABLE_ROWS`` trajectories, every turn of each; texts cut at ``MAX_CELL_CHARS``."""

from __future__ import annotations

from typing import Any

from sat_cli.rewards.grading import MAX_TABLE_ROWS, cut_cell
from sat_cli.samples import Sample

COLUMNS = [
    "id",
    "sample",
    "turn",
    "input",
    "response",
    "versions",
    "tool_calls",
    "tool_errors",
    "tool_results",
    "reward",
    "trajectory_reward",
    "finish",
]


def turn_segments(s: Sample) -> list[tuple[int, list[int], list[int], list[int]]]:
    """Per turn ``(turn, model ids, their versions, the observation ids after it)``."""
    mask = s.loss_mask if s.loss_mask is not None else [1] * s.response_len
    turns = s.turn_ids if s.turn_ids is not None else [0] * s.response_len
    versions = s.token_versions or [s.weight_version] * s.response_len
    out: dict[int, tuple[list[int], list[int], list[int]]] = {}
    for tok, m, k, v in zip(s.response_ids, mask, turns, versions, strict=True):
        ids, vs, obs = out.setdefault(int(k), ([], [], []))
        if m:
            ids.append(int(tok))
            vs.append(int(v))
        else:
            obs.append(int(tok))
    return [(k, *out[k]) for k in sorted(out)]


def trajectory_table(
    groups: list[list[Sample]],
    rows: list[dict],
    rewards: list | None,
    tokenizer,
    parser: str,
) -> dict[str, Any]:
    """The table (``{"columns", "data"}``, ``mlflow.log_table``'s JSON layout) of a batch's
    trajectories; ``rewards`` per group as the loop trained on them (None: a dropped group)."""
    from sat_cli.envs.toolcalls import parse

    data: list[list[Any]] = []
    index = 0
    for g, (group, row) in enumerate(zip(groups, rows, strict=True)):
        got = rewards[g] if rewards is not None else None
        for j, s in enumerate(group):
            if index >= MAX_TABLE_ROWS:
                return {"columns": list(COLUMNS), "data": data}
            steps = s.meta.get("steps") if isinstance(s.meta, dict) else None
            seen = tokenizer.decode(list(s.prompt_ids))
            for k, ids, vs, obs in turn_segments(s):
                text = tokenizer.decode(ids, skip_special_tokens=True)
                parsed = parse(parser, text)
                step = steps[k] if steps is not None and k < len(steps) else None
                results = (
                    None
                    if step is None
                    else [m.get("content") for m in step.observation if m.get("role") == "tool"]
                )
                data.append(
                    [
                        str(row.get("id")),
                        index,
                        k,
                        cut_cell(seen),
                        cut_cell(text),
                        vs,
                        [{"name": c.name, "arguments": c.arguments} for c in parsed.calls],
                        parsed.errors,
                        results,
                        None if step is None else step.reward,
                        None if got is None else float(got[j]),
                        s.finish_reason,
                    ]
                )
                seen = tokenizer.decode(obs)
            index += 1
    return {"columns": list(COLUMNS), "data": data}
