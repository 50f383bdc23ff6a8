"""Real vLLM and SGLang engines behind the router (``scripts/test-real-engines``).

Collected only when ``PDR_REAL_ENGINES=1`` (set by that script): the engines live in their own
virtual environments (``.venv-vllm``, ``.venv-sglang``) and take minutes to install and start.
"""
