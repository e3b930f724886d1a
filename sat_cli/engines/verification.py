"""How an engine's served weights are verified (``engine.verify_weights``): every engine
declares it as its ``weight_verification`` (``engines/base.RolloutEngine``), and an engine that
declares nothing is refused, so none is silently never verified. Torch-free.

- :class:`Checksums` — after a load, ``served_checksums()`` must equal the checksums of what
  the trainer sent, computed on the trainer's side in the engine's naming (``layout``:
  ``weightsync/layouts.py``); ``loop/weightsync.py`` compares them as ``engine.verify_weights``
  says (``first``, ``every``).
- :class:`OnArrival` — the engine checks each version itself as it loads it and refuses one
  that is not what was sent (``EngineError``: SGLang's LoRA adapters, whose log-prob probe is
  the served-side check); ``how`` says with what.
- :class:`Unverified` — it cannot check; ``reason`` says why. A run refuses it (exit 2) unless
  ``engine.verify_weights=off``, and then says so.

:func:`require_verification` is the check a run makes once its engine is built.
"""

from __future__ import annotations

from dataclasses import dataclass

from sat_cli.errors import UserError


@dataclass(frozen=True)
class Checksums:
    layout: str  # the served tensors' names and fusion (weightsync/layouts.py LAYOUTS)

    def describe(self) -> str:
        return f"per-tensor checksums in the {self.layout!r} layout"


@dataclass(frozen=True)
class OnArrival:
    how: str  # what the engine checks each version with as it loads it

    def describe(self) -> str:
        return f"on arrival: {self.how}"


@dataclass(frozen=True)
class Unverified:
    reason: str  # why this engine cannot check what it serves

    def __post_init__(self) -> None:
        if not self.reason.strip():
            raise ValueError("Unverified needs its reason")

    def describe(self) -> str:
        return f"unverified: {self.reason}"


Verification = Checksums | OnArrival | Unverified
KINDS = (Checksums, OnArrival, Unverified)


def checksum_layout(engine) -> str | None:
    """The layout its served checksums are compared in (None: the loop compares none)."""
    declared = getattr(engine, "weight_verification", None)
    return declared.layout if isinstance(declared, Checksums) else None


def require_verification(engine, name: str, verify: str, log=print) -> Verification:
    """The verification ``engine`` (``engine=<name>``) declares, checked against
    ``engine.verify_weights=<verify>`` (module docstring): ``UserError`` when it declares none,
    or declares itself unverified while verification is asked for."""
    declared = getattr(engine, "weight_verification", None)
    if not isinstance(declared, KINDS):
        raise UserError(
            f"engine={name} does not declare how its weights are verified "
            "(weight_verification: Checksums, OnArrival or Unverified with its reason; "
            "sat_cli/engines/verification.py): its weights would never be checked"
        )
    if isinstance(declared, Unverified):
        if verify != "off":
            raise UserError(
                f"engine={name} cannot verify the weights it serves ({declared.reason}); "
                f"engine.verify_weights={verify} asks for it: set engine.verify_weights=off "
                "to run with unverified weights"
            )
        log(f"engine={name}: its weights are not verified ({declared.reason})")
    return declared
