"""Weight sync without the disk (``engine.weight_sync=distributed``) and proof that the weights
arrived (``engine.verify_weights``).

- ``group``   — the weight-update process group, made as SGLang 0.5.23 makes its side
  (``init_custom_process_group``: a ``PrefixStore`` named after the group over a TCP store
  whose master is the trainer's sender, rank 0); closing it fails the peers' pending receives
- ``buckets`` — bucket plans (``engine.weight_sync_bucket_mb``), SGLang's flattened-bucket
  byte layout, and SGLang's per-tensor hash (``/weights_checker`` ``checksum``)
- ``layouts`` — the tensors an engine serves, as named and fused there (SGLang's ``qkv_proj``,
  ``experts.w13_weight``; the local engine's HF names), for the expected checksums
- ``sender``  — :class:`WeightSender`: the trainer's weight versions held in memory and the
  broadcast of their buckets; ``service`` puts one in the Megatron worker's rank 0 behind a
  socket (:class:`RemoteSender` is the driver's proxy)

The engines' halves live with the engines (``engines/local/sync.py``,
``engines/sglang/dist_sync.py``); the transports (disk, distributed: one class each) are
``loop/transports.py`` and the policy (which path, verification, the disk fallback, metrics)
``loop/weightsync.py``. docs/sglang.md "Weight sync" describes the protocol.
"""
