"""Multi-turn environments and their tools (docs/environments.md), torch-free: the environment
interface and its registry (base.py), tool-call parsers (toolcalls.py), the tool sandbox
(sandbox.py, confine.py) and the calculator environment (calculator.py)."""
