"""Distillation: a teacher system solves the world's tasks; filters keep good trajectories."""

from coa_jax.distill.job import FilterConfig, run, to_trajectory
from coa_jax.distill.chat_teacher import ChatTeacher
from coa_jax.distill.teacher import ScriptedTeacher, TeacherConfig, Trace
