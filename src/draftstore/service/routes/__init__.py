"""The service's routes, one module per resource; each handler calls the ``Store`` and nothing else."""
