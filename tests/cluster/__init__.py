"""A real Slurm cluster (munged, slurmctld, 2-4 slurmd nodes) started by the test suite.

See :mod:`tests.cluster.cluster`; the ``slurm_cluster`` fixture lives in ``tests/conftest.py``.
"""
