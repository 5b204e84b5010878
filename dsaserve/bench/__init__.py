"""Agentic workloads and benchmark drivers: synthetic multi-turn traces (traces.py) and the AgentX
harness / in-process replay runner that turns them into headline numbers (agentx.py)."""
