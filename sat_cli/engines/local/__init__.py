"""The local engine: ``LocalEngine`` (engine.py) drives a worker process (worker.py) that samples
from the HF model; inflight.py switches weights inside a running request, sync.py is the
worker's half of the distributed weight sync; settings.py is its ``engine=local`` settings
(torch-free, so importing this package imports no engine until ``LocalEngine`` is asked for)."""

from sat_cli.engines.local.runtime import LocalEngineRuntime
from sat_cli.engines.local.settings import LocalEngineSettings

__all__ = ["LocalEngine", "LocalEngineRuntime", "LocalEngineSettings"]


def __getattr__(name: str):
    if name == "LocalEngine":
        from sat_cli.engines.local.engine import LocalEngine

        return LocalEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
