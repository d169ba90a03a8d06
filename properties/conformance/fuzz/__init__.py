"""Generative conformance (`decodespec fuzz`): generated script cases judged as `conform` judges them.

strategies.py draws examples (a script case's inputs) with Hypothesis; batch.py compiles a batch
into forced checkpoints and has an engine answer it on one start; shrink.py reduces a failure to the
smallest example failing with the same symptom and basis; session.py runs the budget and writes the
minimal cases and the report.
"""
