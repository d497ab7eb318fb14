"""The command line: ``stager COMMAND``, ``stage-in`` and ``stage-out`` (parsing only; no logic)."""
