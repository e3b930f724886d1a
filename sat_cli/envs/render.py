"""Chat messages to token ids, piece by piece, for token-in/token-out trajectories (issue 43).

A trajectory is never re-tokenised: its first prompt is tokenised once (``prompt_ids``), every
model turn is the engine's ids as returned, and every environment answer is tokenised once as
the piece that follows a model turn (``observation_ids``): what the chat template writes after
the model's end-of-turn token (e.g. ChatML's ``\\n``), the observation messages, and the next
generation prompt. The trainer's sequence is exactly the concatenation.

Two renderers:

* ``ChatRenderer``: the tokenizer's own chat template. The piece after a model turn is cut out
  of the template's rendering of a fixed two-message conversation with and without the
  observation (the longer must extend the shorter token for token, else ``ValueError``); the
  closing after the end-of-turn token is what the template writes after the last stop id of
  the shorter one.
* ``PlainRenderer``: a tokenizer without a chat template (the embedded char-level model):
  ``"<content>\\n"`` per message, the prompt's messages and each observation alike.

``renderer_for(tokenizer)`` picks the chat template when the tokenizer has one.
"""

from __future__ import annotations

from collections.abc import Iterable

from sat_cli.envs.base import Message

_BASE: list[Message] = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "."}]


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class PlainRenderer:
    """Messages as ``"<content>\\n"`` each, for tokenizers without a chat template."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        return _encode(self.tokenizer, "".join(f"{m['content']}\n" for m in messages))

    def observation_ids(
        self, observation: list[Message], stop_ids: Iterable[int] = ()
    ) -> list[int]:
        return self.prompt_ids(observation)


class ChatRenderer:
    """The tokenizer's chat template, piece by piece (module docstring)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def _ids(self, messages: list[Message], generation_prompt: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
        return _encode(self.tokenizer, text)

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        return self._ids(messages, True)

    def observation_ids(
        self, observation: list[Message], stop_ids: Iterable[int] = ()
    ) -> list[int]:
        """The ids after a model turn that ended with one of ``stop_ids``: the template's
        closing of that turn, ``observation`` and the next generation prompt."""
        before = self._ids(_BASE, False)
        after = self._ids(_BASE + list(observation), True)
        if after[: len(before)] != before:
            raise ValueError(
                "the chat template does not render a conversation as a prefix of its "
                "continuation; its observation pieces cannot be cut out token for token"
            )
        stops = set(stop_ids) | {self.tokenizer.eos_token_id}
        ends = [i for i, t in enumerate(before) if t in stops]
        closing = before[ends[-1] + 1 :] if ends else []
        return closing + after[len(before) :]


def renderer_for(tokenizer) -> ChatRenderer | PlainRenderer:
    """``ChatRenderer`` when ``tokenizer`` has a chat template, else ``PlainRenderer``."""
    if getattr(tokenizer, "chat_template", None):
        return ChatRenderer(tokenizer)
    return PlainRenderer(tokenizer)
