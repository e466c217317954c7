"""The error every model loader raises (engine/model/loading.py and the loaders it calls)."""


class ModelLoadError(RuntimeError):
    """The model could not be loaded. `str(error)` is one line: what was tried and what to do."""
