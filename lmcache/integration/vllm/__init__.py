"""vLLM integration: KV connector (``vllm_v1_adapter``, ``lmcache_connector_v1``) and
encoder-cache connector (``vllm_ec_adapter``). All knowledge of vLLM lives here."""
