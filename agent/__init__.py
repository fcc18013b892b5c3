"""Agents: one definition each, run unchanged by every backend and by evaluation (`conf/agent/*.yaml`)."""
