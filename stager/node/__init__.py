"""What is on this node, and cleaning it: ``stager ls``, ``stager du``, ``stager clean``.

:mod:`~stager.node.jobs` asks Slurm which jobs have not ended; :mod:`~stager.node.inventory`
scans jobs' scratch directories and the cache into frozen values; :mod:`~stager.node.render`
turns them into rows; :mod:`~stager.node.clean` decides, purely, which directories go.
"""
