"""Parameter search (``ropescale search``): the numeric parameters of any registered strategy
tuned for a model and target length(s) on a search split — the search space from the strategy's
``Param`` ranges (``space``), the objective on a loaded model (``objective``), an Optuna study that
resumes and can be shared by several processes (``tuner``), the run folder (``run``) and its
config (``config``)."""
