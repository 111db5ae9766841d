"""The engine: one loop for every task (``trainer.Trainer``), the phases of a run (``experiment.run_phases``,
``experiment.train_run``: the entry point of `sinkflow train` and ``sinkflow.train``) and the loop's own
guards (non-finite steps, divergence, health metrics, batches made ahead on worker threads).

It sits above the methods: it runs their tasks (``methods.base``) and never names a method.
"""
