"""``--agent-function-path``: an OpenAI-compatible ``/v1/chat/completions`` served by the run for the user's agent
(``server.py``), every completion recorded as token ids and log-probs per agent session, the session's sample
assembled from those records (``trajectory.py``), the agent called per sample (``agent.py``). docs/agentic.md."""
