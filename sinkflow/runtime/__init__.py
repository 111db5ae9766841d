"""The runtime methods build on: the run folder (``run_folder.RunFolder``), checkpoints and their content checks,
the run's identity and lock, RNG streams, signals, DDP helpers, the metrics log and the ``Callback`` protocol.

Nothing here knows a method or the training loop: methods import these pieces, the engine (``sinkflow.engine``)
drives them.
"""
