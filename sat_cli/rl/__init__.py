"""Policy-loss library: pure tensor functions (SAT bounds, surrogates, corrections, advantages).

Import the submodules directly (``sat_cli.rl.losses``, ``sat_cli.rl.sat``, ...); this package
file stays import-free so ``import sat_cli`` never pulls in torch.
"""
