"""Evaluation suites users compare models by: tasks scored by the rules of the field (below the
stages: `lmforge eval --tasks` and training's periodic `train.eval_tasks` share it).

    metrics    accuracy with ties at 1/k, the random baseline, the centred score, intervals,
               pass@k (Chen et al. 2021's unbiased estimator)
    tasks      a task's items (multiple choice, or a continuation to predict greedily), the
               user's own tasks from JSONL / Parquet
    builtin    the built-in tasks on the embedded corpus's held-out modules (no download)
    scoring    log-likelihoods of continuations under a model, at lm-evaluation-harness's token
               boundaries
    suite      a set of tasks scored, with the suite's one number (the mean centred score)
"""
