"""The benchmark: ``python -m bench`` (see :mod:`bench.run`)."""
