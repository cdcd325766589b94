"""The core: next-token distributions, divergences, acceptance rules, and the decoding engine.

Nothing here reads files, talks to a network or knows any model's name: these modules take tensors
and models and return tensors and tokens. Everything else in fuzzyspec (drafters, loading, training,
evaluation, serving, the command line) is built around them.
"""
