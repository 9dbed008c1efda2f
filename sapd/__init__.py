"""sapd: Step-Advantage Policy Distillation — refine LLM agents from recorded interaction histories."""

__version__ = "0.1.0"
