"""Shared utilities with no sat-specific knowledge: fsio.py (atomic writes, staged folders,
reads of regular files only), procs.py (ports, process groups, log tails), signals.py
(SIGTERM/SIGHUP as exceptions, deferred signals)."""
