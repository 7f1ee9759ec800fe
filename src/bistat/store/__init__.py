"""What a run leaves on disk, one module per job: ``format`` (the names, schemas, JSON encoding
and hashes of the records), ``writer`` (appending them), ``readers`` (reading them back, whichever
way a table is stored), ``compact`` (Parquet beside the JSONL, plain or slim), ``passes`` (which
recorded passes count), ``run_dir`` (a run directory opened once, and where its registration
is) and ``enginelog`` (the engine logs kept beside the records). Slimming a run for committing
(``bistat compact --trim``) reads the analysis, so it lives in ``bistat.analysis.trim``.
"""
