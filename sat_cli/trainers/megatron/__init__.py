"""megatron-core trainer backend (``trainer=megatron``): a torchrun worker driven by a client.

Modules: ``cpu_shims`` (CPU-only patches), ``model`` (GPTModel from a HF Qwen3-MoE config),
``convert`` (HF ⇄ Megatron weights), ``runtime`` (distributed setup, log-probs, R3 replay),
``worker`` (the torchrun process), ``client`` (``MegatronTrainer``, the orchestrator side).
Nothing is imported here, so importing the package does not need megatron-core.
"""
