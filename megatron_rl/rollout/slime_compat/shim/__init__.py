"""The directory that holds the ``slime`` compatibility package (``shim/slime``), found by ``finder.py`` only when
no real slime is importable. Never imported under this name by the run."""
