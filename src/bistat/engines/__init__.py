"""The engines bistat measures: the engine protocol every adapter implements (``base``), the
registry of engine kinds (``registry``), the adapters (``openai_http``, naming its parts
``http_retry``, ``openai_answers`` and ``http_workload``; ``vllm_server``, ``vllm_offline``,
``embedded.adapter``), Prometheus metrics parsing (``metrics``), bistat's own
numpy engine (``embedded/``) and the HTTP server that serves it (``serve/``).
"""
