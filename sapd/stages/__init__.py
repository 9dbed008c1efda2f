"""One module per pipeline stage, named like its job (``sapd/jobs/<name>.py``) and its chart block:
build_prefixes, teacher_scores, train (on an engine of :mod:`sapd.engines`), evaluate. Each exposes the
same entry, ``run(ctx, step) -> Outcome`` (:mod:`sapd.stages.context`). Stages never import each other;
they meet only through the run root."""
