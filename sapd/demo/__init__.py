"""``sapd demo``: the method end to end on a CPU in minutes (:mod:`sapd.demo.main`), and the kit it is built
from — seeded TextWorld games (:mod:`~sapd.demo.games`) and expert pools (:mod:`~sapd.demo.pools`), a
tokenizer and small models made by ``sapd run`` configs (:mod:`~sapd.demo.models`), held-out evaluation
(:mod:`~sapd.demo.evaluation`) with 95 % intervals (:mod:`~sapd.demo.intervals`), parallel jobs
(:mod:`~sapd.demo.workers`) and progress (:mod:`~sapd.demo.progress`). The research studies (``research/``,
not installed) build on the same kit."""
