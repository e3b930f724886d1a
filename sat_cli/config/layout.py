"""The config side of trainer layouts: the model's architecture (``model.*`` → its ``config.json``
fields → ``sat_cli.models.arch.Arch``, read by ``sat_cli.models.fields``) and the sequence length
of the activation estimate, for `sat plan` and a cluster job's needs. Torch-free (``json`` only).
``trainer=megatron``'s compose-time check (layout rules, memory estimate) is its registry
entry's (``sat_cli.trainers.megatron.checks``).
"""

from __future__ import annotations

from sat_cli.devices.memory import PROMPT_TOKENS
from sat_cli.models import fields
from sat_cli.models.arch import Arch


def model_config(obj) -> tuple[dict | None, str]:
    """(the model's ``config.json`` fields, where they came from); (None, why) when they are
    not known here (``sat_cli.models.fields``)."""
    return fields.model_config(obj.model)


def architecture(obj) -> tuple[Arch | None, str]:
    """(architecture, where it came from); (None, why) when it is not known here."""
    return fields.architecture(obj.model)


def sequence_tokens(obj) -> int:
    return PROMPT_TOKENS + obj.task.max_new_tokens
