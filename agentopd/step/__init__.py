"""One training step as a chain of stages, each returning a typed value that carries its own metrics.

    played = play(step)                                     # play.py     Played
    scored = score(played, parts)                           # score.py    Scored
    samples = prepare(played, scored, parts)                # train.py    Samples
    trained = train(samples, parts)                         # train.py    Trained
    synced = sync(played, parts, engines)                   # train.py    Synced
    metrics = report(played, scored, samples, trained, synced, parts, flops)   # report.py

The runner (agentopd.runner) composes them in `Runner._step` and keeps only what lives across steps. `parts`
(values.py `StepParts`) are the run's parts the stages read: backend, mixture, router, store, phases, recipes.
Recipes (agentopd.recipes.base) change the stages they name through hooks; recipes.py builds the run's list.
phases.py: the phase running now, its progress bar and memory peaks; evals.py: eval steps. docs/design.md 9 walks
through one step file by file.
"""
