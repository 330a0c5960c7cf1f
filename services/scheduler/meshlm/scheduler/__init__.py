"""meshlm.scheduler: SGLang's Scheduler -> TpModelWorker -> ModelRunner -> Model path.

The in-process entry point is `meshlm.scheduler.engine.Engine`.
"""
