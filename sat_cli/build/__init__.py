"""THE EDGE: the typed config in, objects and plain values out; below it nothing reads the
config. ``parts.py``: the model path, task, loss settings, sampling and evaluation;
``components.py``: the engine, trainer and launcher, each built by its registered component
from its own settings (``sat_cli.registry``); ``run.py``: what `sat train` hands its loop
and its MLflow tracker."""
