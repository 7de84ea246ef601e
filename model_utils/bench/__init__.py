"""`python -m model_utils.bench`: the engine's decode path against plain generate (run,
per_mode, measure, report), at conversation lengths (long_context), and the correctness checks
(logprob_check, quality, greedy_compare) on a model with peaked distributions (peaked_model).
"""
