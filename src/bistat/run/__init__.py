"""Recording a run: the run loop with resume and GPU checks (``runner``), the prompts it sends
(``workload``), the environment fingerprint (``fingerprint``) and the batching summary the runner
writes and analysis recomputes with the same function (``batching``), and the bitwise
needle-in-batch ``probe`` run on the engines with what it records (``probe_records``).
"""
