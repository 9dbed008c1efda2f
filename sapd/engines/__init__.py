"""The training engines behind one protocol (:class:`sapd.engines.base.Engine`): plain torch on one process
(:mod:`sapd.engines.torch_engine`) and DeepSpeed ZeRO on one or more (:mod:`sapd.engines.deepspeed_engine`).
The train stage (:mod:`sapd.stages.train`) picks one with :func:`sapd.engines.base.engine_factory_for` and
writes its loop against the protocol; an engine knows nothing of stages, rounds or the run root."""
