"""Cluster engines behind `sat`: Ray places a run's processes (``launcher=ray``: launcher.py,
hosts.py, remote.py, guard.py, ray_env.py), ``sat sweep --executor slurm|ray`` submits runs
(executors.py), ``sat mlflow-server`` serves one tracking store to every node
(mlflow_server.py). Ray and submitit are optional extras, imported only inside functions.
"""
