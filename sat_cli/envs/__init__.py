"""Multi-turn environments and their tools (docs/environments.md), torch-free: the environment
interface and its registry (base.py, registry.py), tool-call parsers (toolcalls.py), the tool
sandbox (sandbox.py, confine.py, launch.py), the calculator and guess environments
(calculator.py, guess.py), their teachers for a format warm start (plain.py) and the multi-turn
driver (trajectory.py, render.py)."""
