"""The local engine: ``LocalEngine`` (engine.py) drives a worker process (worker.py) that samples
from the HF model; inflight.py switches weights inside a running request, sync.py is the
worker's half of the distributed weight sync."""

from sat_cli.engines.local.engine import LocalEngine

__all__ = ["LocalEngine"]
