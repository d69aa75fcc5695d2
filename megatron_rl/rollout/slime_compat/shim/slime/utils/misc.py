"""slime's ``load_function`` (a dotted ``pkg.module.attr`` path) and ``SingletonMeta``."""

import importlib
import threading


def load_function(path):
    """The attribute ``path`` names: ``pkg.module.attr`` (slime's form) or ``module:attr``."""
    module_name, sep, attr = path.rpartition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module_name), attr)


class SingletonMeta(type):
    """One instance per class (slime's ``GenerateState`` is one per process)."""

    _instances: dict = {}
    _lock = threading.Lock()

    def __call__(cls, *args, **kwargs):
        with cls._lock:
            if cls not in cls._instances:
                cls._instances[cls] = super().__call__(*args, **kwargs)
            return cls._instances[cls]

    def clear_instances(cls):
        """Forget this class's instance (the next call builds a new one), as slime's does."""
        with SingletonMeta._lock:
            SingletonMeta._instances.pop(cls, None)
