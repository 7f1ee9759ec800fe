"""bistat_kernels: a tuned batch-invariant Triton GEMM for vLLM's batch-invariant mode.

Modules (one concept each): ``matmul_persistent`` (the launcher; the kernels are in
``matmul_kernels``), ``tables`` (config table schema, loading, M-bucket lookup), ``probe`` (the
two gates), ``sweep`` (tuning), ``bench`` (tuned vs torch.mm vs default), ``timing`` (CUDA-graph
timing), ``shapes`` (model GEMM shapes), ``provenance``, ``make_results`` (RESULTS.md:
``results_model`` and its ``results_*`` parts compute the numbers, ``templates/RESULTS.md.j2``
words them), ``vllm_plugin`` (the vLLM general plugin).
Importing this package imports nothing heavy: torch and triton load with the modules that need
them. See ``kernels/README.md`` (the folder that holds this package).
"""
