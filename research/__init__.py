"""The research harness, outside the installed package: the reproduction study (``reproduction``, its report
and the Appendix A.5 checks), the powered study (``powered``, ``powered_report``, ``signals``, ``stats``),
sequential training (``sequential``) and the SmolLM2 run. Its front door is ``python -m research``; it builds
on ``sapd`` (the product) and nothing in ``sapd`` imports it."""
