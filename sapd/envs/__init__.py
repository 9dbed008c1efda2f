"""Environments for evaluation and expert-data collection (never used by training)."""

from sapd.envs.base import Environment, ExpertEnvironment, ReplayEnv, StepInfo, StepResult

__all__ = ["Environment", "ExpertEnvironment", "ReplayEnv", "StepInfo", "StepResult"]
