"""sat: asynchronous RL experiment runner (SAT paper reproduction)."""

__version__ = "0.1.0"
