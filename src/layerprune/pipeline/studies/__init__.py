"""Studies built of runs: the pruning-ratio sweep (sweep.py; one k of it is a recovery study), the grain study
(grain.py) and the variant study (variant.py), each a list of stages run by pipeline/runner.py, with its report writer
beside it."""
