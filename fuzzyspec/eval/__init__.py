"""Measuring decoding: ``bench`` (accuracy/speed sweeps), ``tasks`` (HumanEval, GSM8K, CSQA, free-form),
``quality`` (reference-free quality), ``calibrate`` (picking T), ``execution`` (running model-written
code), ``plot`` (the curve) and ``lmeval`` (the lm-evaluation-harness model)."""
