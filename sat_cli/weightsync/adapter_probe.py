"""The log-prob probe of a LoRA adapter: proof that the engine serves the version it was sent.

The checksums (``weightsync.adapters``) prove the adapter's *files* are what the trainer wrote;
the probe proves the *engine* computes with them. When the trainer publishes a version it
scores a fixed token sequence (:func:`probe_ids`, :data:`PROBE_LEN` tokens) with its own model
at that version and writes the log-probs of tokens 1.. into the adapter's config (``probe``:
``{"ids", "logprobs"}``). After the engine loads the adapter it scores the same sequence with
it (the local engine in its worker, SGLang with one ``/generate`` naming the adapter) and
:func:`check_probe` compares: a difference beyond the tolerance is :class:`AdapterDamaged`
(a ``WeightsMismatch``), handled like a checksum mismatch (the loop tries the disk once more,
then the run fails closed).

Tolerance (:func:`tolerance`): the engine's dtype sets it. ``float32`` (the local engine on the
CPU): the largest |difference| must be at most 1e-3 (measured: below 1e-5, the same HF model
and LoRA in another batch shape). ``bfloat16``/``float16`` (SGLang on the CPU, GPUs): the *mean*
|difference| must be at most 0.5: bf16 rounding and, on a MoE model, expert routes that flip
between the trainer's fp32 and the engine's bf16 move single tokens by up to ~1.4 nats on an
arbitrary sequence (measured on the tiny MoE: mean 0.04 to 0.2). So at bf16 the probe catches
the base served in place of an adapter, or an adapter of another run or far older version, not
a neighbouring version whose log-probs differ by less than that noise (the checksums still
pin the files). A probe-less config (an adapter written before the probe existed) is not
probed.
"""

from __future__ import annotations

from sat_cli.weightsync.adapters import AdapterDamaged

PROBE_LEN = 16
TOLERANCE = {"float32": ("max", 1e-3), "bfloat16": ("mean", 0.5), "float16": ("mean", 0.5)}


def probe_ids(vocab_size: int) -> list[int]:
    """The fixed probe sequence for a vocabulary of ``vocab_size`` tokens (no token 0, often
    the padding id)."""
    span = max(int(vocab_size) - 1, 1)
    return [1 + (3 + 7 * i) % span for i in range(PROBE_LEN)]


def model_logprobs(model, ids: list[int]) -> list[float]:
    """``log p(ids[t] | ids[:t])`` for t >= 1 under an HF causal LM (no grad, eval mode; the
    model's mode is restored)."""
    import torch

    was = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        x = torch.tensor([ids], device=device)
        with torch.no_grad():
            logits = model(input_ids=x, use_cache=False).logits.float()[0, :-1]
        lp = torch.log_softmax(logits, -1).gather(1, x[0, 1:, None])[:, 0]
        return [float(v) for v in lp.cpu()]
    finally:
        model.train(was)


def trainer_probe(model) -> dict:
    """The ``probe`` entry of an adapter config: the ids and the trainer's log-probs."""
    ids = probe_ids(model.config.vocab_size)
    return {"ids": ids, "logprobs": model_logprobs(model, ids)}


def tolerance(dtype: str) -> tuple[str, float]:
    """``(statistic, bound)`` of the engine's dtype (module docstring)."""
    return TOLERANCE.get(str(dtype), TOLERANCE["bfloat16"])


def check_probe(config: dict, served: list[float], dtype: str, where: str) -> float:
    """Compare the engine's probe log-probs ``served`` with the trainer's in ``config``; the
    statistic the tolerance bounds, or :class:`AdapterDamaged`."""
    want = [float(v) for v in config["probe"]["logprobs"]]
    if len(served) != len(want):
        raise AdapterDamaged(
            f"{where}: the probe gave {len(served)} log-probs, the trainer {len(want)}"
        )
    diffs = [abs(float(a) - b) for a, b in zip(served, want, strict=True)]
    stat, bound = tolerance(dtype)
    value = max(diffs) if stat == "max" else sum(diffs) / len(diffs)
    if not value <= bound:  # NaN fails too
        raise AdapterDamaged(
            f"{where} does not serve adapter v{config['version']} the trainer wrote: its "
            f"log-probs of the probe sequence differ by {stat} {value:.4g} > {bound:g} "
            f"({dtype}); the engine computes with other weights than those checked"
        )
    return value
