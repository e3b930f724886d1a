"""The embedded default model: a tiny Qwen3-MoE in Hugging Face format, and its char tokenizer.

``build_tiny_moe(seed)`` makes a randomly initialised ``Qwen3MoeForCausalLM`` (4 layers, 8 experts,
top-2, hidden 128, ~1.0 M parameters; STACK.md) and ``build_char_tokenizer()`` a character-level
tokenizer built offline with ``tokenizers`` (WordLevel over printable ASCII, ``Split("")``
pre-tokenizer, ``Fuse`` decoder) wrapped in ``PreTrainedTokenizerFast``. ``save_hf`` writes both
with ``save_pretrained`` (config.json, model.safetensors, tokenizer files), atomically, so the
folder loads with plain ``AutoModelForCausalLM`` / ``AutoTokenizer`` and is the checkpoint format
the engines and trainers exchange. ``load_model`` is the one loader used by the local engine and
the local trainer, for the tiny model and for real hub/local checkpoints alike.

Simplification: the tokenizer has no BOS token and no chat template; prompts are raw text and a
response ends with ``<eos>``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from sat_cli.models.arch import TINY_MOE_CONFIG  # torch-free: `sat plan` reads it too

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN)  # ids 0, 1, 2
# Printable ASCII (space .. ~) plus newline and tab: 95 + 2 characters, ids 3..99.
CHARS = tuple(chr(c) for c in range(32, 127)) + ("\n", "\t")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"float32"`` / ``"bfloat16"`` / ``"float16"`` (or a torch dtype) to a torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: use one of {sorted(DTYPES)}")
    return DTYPES[name]


def build_char_tokenizer():
    """The char-level tokenizer: ``<pad>``=0, ``<eos>``=1, ``<unk>``=2, then one id per character."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN, unk_token=UNK_TOKEN
    )


def build_config(**overrides):
    """``Qwen3MoeConfig`` of the tiny model, with optional field overrides (e.g. ``num_hidden_layers``)."""
    from transformers import Qwen3MoeConfig

    kwargs = {**TINY_MOE_CONFIG, **overrides}
    cfg = Qwen3MoeConfig(**kwargs, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    return cfg


def build_tiny_moe(seed: int = 0, **overrides):
    """A freshly initialised tiny ``Qwen3MoeForCausalLM`` (fp32, eval mode), deterministic in ``seed``."""
    from transformers import Qwen3MoeForCausalLM

    cfg = build_config(**overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(cfg)
    return model.eval()


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def save_hf(model, tokenizer, path: str | os.PathLike) -> Path:
    """Write ``model`` (+ ``tokenizer`` if given) with ``save_pretrained`` to ``path``, atomically.

    The files are written to a temporary sibling directory that is then renamed over ``path``
    (an existing ``path`` is removed first), so a reader never sees a half-written checkpoint.
    """
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    from sat_cli.util.fsio import staged_dir

    path = Path(path)
    with staged_dir(path) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        # mkdtemp makes the folder private; published weights are read by other processes
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
    return path


def load_model(
    path_or_hub_id: str | os.PathLike, dtype: str | torch.dtype = "float32", device="cpu"
):
    """Load an HF causal LM (a local folder or a hub id already in the local cache), in eval mode.

    Used by the local engine and the local trainer. SDPA attention; the experts implementation is
    transformers' default for the model. Turns off transformers' progress bars (process-wide).
    A local folder is checked completely first (``sat_cli.models.weights_check``) and any tensor
    transformers reports missing, unexpected or mismatched raises ``WeightsError``: a weight is
    never silently initialised at random — also for checkpoints loaded mid-run.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no per-load progress bars in engine/trainer logs
    if Path(path_or_hub_id).is_dir():  # every tensor present, expected, of the right shape/dtype
        from sat_cli.models.weights_check import check_hf_dir

        check_hf_dir(path_or_hub_id, "weights")
    model, info = AutoModelForCausalLM.from_pretrained(
        str(path_or_hub_id),
        dtype=torch_dtype(dtype),
        attn_implementation="sdpa",
        use_safetensors=True,  # never fall back to pickle weights (a hub id is not pre-checked)
        output_loading_info=True,
    )
    bad = {k: sorted(v) for k, v in info.items() if k != "error_msgs" and v}
    if bad or info.get("error_msgs"):  # transformers would fill the gaps with random weights
        from sat_cli.models.weights_check import WeightsError

        raise WeightsError(
            f"weights={str(path_or_hub_id)!r} do not match the model: "
            + "; ".join(f"{k}: {', '.join(map(str, v[:4]))}" for k, v in bad.items())
            + "; ".join(str(e)[:200] for e in info.get("error_msgs") or [])
        )
    return model.to(device).eval()


def load_tokenizer(path_or_hub_id: str | os.PathLike):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path_or_hub_id))


def moe_gates(model) -> list[torch.nn.Module]:
    """The router modules (``mlp.gate``) of the MoE layers, in layer order.

    Raises ``ValueError`` for a model without them (R3 needs a Qwen3-MoE-style block).
    """
    layers = model.model.layers
    gates = [layer.mlp.gate for layer in layers if hasattr(layer.mlp, "gate")]
    if not gates:
        raise ValueError(
            f"{type(model).__name__} has no MoE routers (mlp.gate): R3 needs an MoE model"
        )
    return gates
