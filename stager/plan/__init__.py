"""Pure planning, torch-free: which shards a node stages, which samples a rank and worker read.

Everything here is a function of counts, sizes, the job's layout, the epoch and the seed: no I/O, no
processes. stage-in (in a Slurm prologue, without torch) and the loader both import it, so the two
always agree.
"""
