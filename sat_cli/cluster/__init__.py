"""Cluster engines behind `sat`: Ray places a run's processes (``launcher=ray``: launcher.py,
hosts.py, remote.py, guard.py, ray_env.py), ``sat sweep --executor slurm|ray`` submits runs
(executors.py). ``sat mlflow-server``, the one tracking store every node logs to, is a command
(``sat_cli.commands.mlflow_server``). Ray and submitit are optional extras, imported only inside functions.
"""
