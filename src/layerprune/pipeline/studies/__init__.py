"""Studies built of runs: the recovery study (recovery.py), the pruning-ratio sweep (sweep.py) and the variant study
(variant.py), each a list of stages run by pipeline/runner.py, with its report writer beside it."""
