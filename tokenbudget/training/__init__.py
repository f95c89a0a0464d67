"""Training draft heads for a target model: ``tokenbudget train-draft``.

The EAGLE-3 pipeline (``pipeline.run_pipeline``) in resumable stages under one work directory:
prompts the target writes itself (plus text shipped in installed packages) -> the target's own
greedy chat responses through the engine -> one teacher-forced forward per conversation recording
the three tap states (docs: issue 27, Contract 2) and the target's next-token top-k -> the draft
vocabulary -> training with EAGLE-3's training-time test -> export in the published layout ->
held-out acceptance. Sits above the front-ends (it generates with ``LLM``) and below the CLI.
"""
