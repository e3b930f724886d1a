"""The SGLang rollout engine (``engine=sglang``), split by concern:

- ``wire``    — request building and response parsing (pure functions, SGLang's wire format)
- ``client``  — the stdlib JSON-over-HTTP client (retries, error bodies, aborting calls)
- ``weights`` — weight sync (``/update_weights_from_disk``)
- ``server``  — launching and supervising ``sglang.launch_server`` / ``sglang_router`` processes
  (on the engine-neutral :class:`sat_cli.engines.managed_server.ManagedServer`)
- ``engine``  — :class:`SGLangEngine`, the ``RolloutEngine`` over one or more servers
  (``control``: its pause / continue / flush / health calls)
- ``settings`` — its ``engine=sglang`` settings and build (torch-free)
- ``cpu_launch`` — a standalone launcher run by SGLang's own interpreter on ``--device cpu``
  (works around two SGLang CPU bugs and the torchvision import; never imported here)
"""

__all__ = ["SGLangClient", "SGLangEngine", "read_moe_dims"]


def __getattr__(name: str):
    if name == "SGLangClient":
        from sat_cli.engines.sglang.client import SGLangClient

        return SGLangClient
    if name == "SGLangEngine":
        from sat_cli.engines.sglang.engine import SGLangEngine

        return SGLangEngine
    if name == "read_moe_dims":
        from sat_cli.engines.sglang.routes import read_moe_dims

        return read_moe_dims
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
