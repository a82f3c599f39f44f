"""Environments for multi-turn agentic RL: the API (base.py), the built-in environments (toy.py,
math_python.py, reasoning_gym.py, verifiers_env.py) and their registry, tools and their calls (tools.py,
tool_calls.py), a sandbox for model-written code (sandbox.py, sandbox_child.py), observations
rendered into token ids (render.py) and the episodes that run them in the engine's continuous batch
(episodes.py)."""
